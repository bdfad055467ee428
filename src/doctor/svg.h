// Inline SVG for lockstep report: line charts and stacked bars, with no scripts and no
// external resources, so a page opens from disk in any browser.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace lockstep::doctor::svg {

std::string esc(const std::string& s);  // HTML-escaped text
std::string num(double v, const char* format = "%.3g");

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;
};

// A line chart: axes with 5 ticks each, one polyline and dots per series.
std::string chart(const std::string& title, const std::vector<Series>& series, const std::string& xlabel,
                  const std::string& ylabel, bool zero_based = false);

// The parts of a step, in the order and colours of the stacked bars.
inline constexpr int kStepParts = 6;  // data wait, forward, backward, exposed comm, optimizer, other

// Horizontal stacked bars, one per row (a label and kStepParts seconds), in milliseconds per step.
std::string stacked(const std::vector<std::pair<std::string, std::vector<double>>>& rows);

}  // namespace lockstep::doctor::svg
