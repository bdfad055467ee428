#include "svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace lockstep::doctor::svg {
namespace {

struct Part {
  const char* name;
  const char* color;
};
const Part kParts[kStepParts] = {{"data wait", "#8c8c8c"}, {"forward", "#4e79a7"},
                                 {"backward", "#59a14f"},  {"exposed communication", "#e15759"},
                                 {"optimizer", "#f28e2b"}, {"other", "#bab0ac"}};

}  // namespace

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string num(double v, const char* format) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// A line chart as inline SVG: axes with 5 ticks each, one polyline and dots per series.
std::string chart(const std::string& title, const std::vector<Series>& series, const std::string& xlabel,
                  const std::string& ylabel, bool zero_based) {
  const double W = 560, H = 260, L = 64, R = 16, T = 30, B = 42;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const auto& s : series)
    for (auto [x, y] : s.points) {
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  std::ostringstream o;
  o << "<figure><svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
    << "' viewBox='0 0 " << W << " " << H << "' role='img' aria-label='" << esc(title) << "'>";
  o << "<text x='" << W / 2 << "' y='18' text-anchor='middle' class='t'>" << esc(title) << "</text>";
  if (x0 > x1) {
    o << "<text x='" << W / 2 << "' y='" << H / 2 << "' text-anchor='middle'>no data</text></svg></figure>";
    return o.str();
  }
  if (zero_based) y0 = std::min(0.0, y0);
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + (y0 == 0 ? 1 : std::abs(y0) * 0.1);
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
  o << "<rect x='" << L << "' y='" << T << "' width='" << W - L - R << "' height='" << H - T - B
    << "' fill='none' stroke='#bbb'/>";
  for (int i = 0; i <= 4; ++i) {
    double yv = y0 + (y1 - y0) * i / 4, xv = x0 + (x1 - x0) * i / 4;
    o << "<line x1='" << L << "' x2='" << W - R << "' y1='" << py(yv) << "' y2='" << py(yv)
      << "' stroke='#eee'/>";
    o << "<text x='" << L - 4 << "' y='" << py(yv) + 4 << "' text-anchor='end' class='a'>" << num(yv)
      << "</text>";
    o << "<text x='" << px(xv) << "' y='" << H - B + 16 << "' text-anchor='middle' class='a'>"
      << num(xv, "%.0f") << "</text>";
  }
  o << "<text x='" << (L + W - R) / 2 << "' y='" << H - 6 << "' text-anchor='middle' class='a'>"
    << esc(xlabel) << "</text>";
  o << "<text x='14' y='" << (T + H - B) / 2 << "' transform='rotate(-90 14 " << (T + H - B) / 2
    << ")' text-anchor='middle' class='a'>" << esc(ylabel) << "</text>";
  int legend = 0;
  for (const auto& s : series) {
    if (s.points.empty()) continue;
    o << "<polyline fill='none' stroke='" << s.color << "' stroke-width='2' points='";
    for (auto [x, y] : s.points) o << px(x) << "," << py(y) << " ";
    o << "'/>";
    for (auto [x, y] : s.points)
      o << "<circle cx='" << px(x) << "' cy='" << py(y) << "' r='2.5' fill='" << s.color << "'><title>"
        << esc(s.name) << " at " << num(x, "%.0f") << ": " << num(y) << "</title></circle>";
    o << "<rect x='" << L + 8 + legend * 150 << "' y='" << T + 6 << "' width='10' height='10' fill='"
      << s.color << "'/><text x='" << L + 22 + legend * 150 << "' y='" << T + 15 << "' class='a'>"
      << esc(s.name) << "</text>";
    ++legend;
  }
  o << "</svg></figure>";
  return o.str();
}

// Horizontal stacked bars, one per row, in milliseconds per step.
std::string stacked(const std::vector<std::pair<std::string, std::vector<double>>>& rows) {
  const double W = 560, L = 110, R = 16, bar = 22, gap = 10;
  double most = 1e-12;
  for (const auto& r : rows) {
    double sum = 0;
    for (double v : r.second) sum += v;
    most = std::max(most, sum);
  }
  const double H = 40 + rows.size() * (bar + gap) + 30;
  std::ostringstream o;
  o << "<figure><svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
    << "' viewBox='0 0 " << W << " " << H << "' role='img' aria-label='step-time breakdown'>";
  o << "<text x='" << W / 2 << "' y='18' text-anchor='middle' class='t'>time per step (ms)</text>";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    double y = 34 + i * (bar + gap), x = L;
    o << "<text x='" << L - 6 << "' y='" << y + 15 << "' text-anchor='end' class='a'>" << esc(rows[i].first)
      << "</text>";
    for (std::size_t k = 0; k < rows[i].second.size() && k < kStepParts; ++k) {
      double w = rows[i].second[k] / most * (W - L - R);
      o << "<rect x='" << x << "' y='" << y << "' width='" << std::max(0.0, w) << "' height='" << bar
        << "' fill='" << kParts[k].color << "'><title>" << kParts[k].name << ": "
        << num(rows[i].second[k] * 1e3, "%.2f") << " ms</title></rect>";
      x += w;
    }
  }
  double ly = H - 16, lx = 8;
  for (int k = 0; k < kStepParts; ++k) {
    o << "<rect x='" << lx << "' y='" << ly - 9 << "' width='10' height='10' fill='" << kParts[k].color
      << "'/><text x='" << lx + 13 << "' y='" << ly << "' class='a'>" << kParts[k].name << "</text>";
    lx += 22 + 6.2 * static_cast<double>(std::string(kParts[k].name).size());
  }
  o << "</svg></figure>";
  return o.str();
}

}  // namespace lockstep::doctor::svg
