#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "lockstep/error.h"

namespace fs = std::filesystem;

namespace lockstep::tools {
namespace {

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

std::string num(double v, const char* format = "%.3g") {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;
};

// A line chart as inline SVG: axes with 5 ticks each, one polyline and dots per series.
std::string chart(const std::string& title, const std::vector<Series>& series, const std::string& xlabel,
                  const std::string& ylabel, bool zero_based = false) {
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

struct Part {
  const char* name;
  const char* color;
};
const Part kParts[] = {{"data wait", "#8c8c8c"}, {"forward", "#4e79a7"},
                       {"backward", "#59a14f"},  {"exposed communication", "#e15759"},
                       {"optimizer", "#f28e2b"}, {"other", "#bab0ac"}};

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
    for (std::size_t k = 0; k < rows[i].second.size() && k < 6; ++k) {
      double w = rows[i].second[k] / most * (W - L - R);
      o << "<rect x='" << x << "' y='" << y << "' width='" << std::max(0.0, w) << "' height='" << bar
        << "' fill='" << kParts[k].color << "'><title>" << kParts[k].name << ": "
        << num(rows[i].second[k] * 1e3, "%.2f") << " ms</title></rect>";
      x += w;
    }
  }
  double ly = H - 16, lx = 8;
  for (int k = 0; k < 6; ++k) {
    o << "<rect x='" << lx << "' y='" << ly - 9 << "' width='10' height='10' fill='" << kParts[k].color
      << "'/><text x='" << lx + 13 << "' y='" << ly << "' class='a'>" << kParts[k].name << "</text>";
    lx += 22 + 6.2 * static_cast<double>(std::string(kParts[k].name).size());
  }
  o << "</svg></figure>";
  return o.str();
}

std::vector<double> parts_of(const nlohmann::json& e) {
  double step = e.value("step_seconds", 0.0), data = e.value("data_seconds", 0.0),
         fwd = e.value("forward_seconds", 0.0), bwd = e.value("backward_seconds", 0.0),
         exp = e.value("exposed_comm_seconds", 0.0), opt = e.value("optimizer_seconds", 0.0);
  return {data, fwd, bwd, exp, opt, std::max(0.0, step - data - fwd - bwd - exp - opt)};
}

}  // namespace

RunData load_run(const std::string& dir, const std::string& doctor_json) {
  RunData run;
  run.dir = dir;
  const fs::path metrics = fs::path(dir) / "metrics.jsonl";
  std::ifstream in(metrics);
  if (!in)
    throw ConfigError("no metrics.jsonl in " + dir + ": pass the --output-dir of a lockstep Trainer run");
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded())
      throw ConfigError(metrics.string() + " has a line that is not JSON: " + line.substr(0, 80));
    if (j.value("event", "") == "train_begin") {
      if (run.begin.is_null()) run.begin = j;
    } else if (j.contains("eval_loss")) {
      run.evals.push_back(j);
    } else if (j.contains("loss")) {
      run.logs.push_back(j);
    }
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path(dir) / "trace", ec)) {
    const std::string name = entry.path().filename().string();
    int rank = -1;
    if (std::sscanf(name.c_str(), "rank_%d.json", &rank) != 1) continue;
    std::ifstream t(entry.path());
    auto events = nlohmann::json::parse(t, nullptr, false);
    if (events.is_discarded() || !events.is_array()) continue;  // a run still writing it
    RankTimes r;
    for (const auto& e : events) {
      if (e.value("ph", "") != "X") continue;
      const std::string n = e.value("name", "");
      const double s = e.value("dur", 0.0) / 1e6;
      if (n == "data wait")
        r.data += s;
      else if (n == "forward")
        r.forward += s;
      else if (n.rfind("backward", 0) == 0)
        r.backward += s;
      else if (n == "optimizer")
        r.optimizer += s, r.steps += 1;
      else if (n == "all-reduce")
        r.allreduce_busy += s;
    }
    if (r.steps > 0) {
      double k = r.steps;
      r.data /= k, r.forward /= k, r.backward /= k, r.optimizer /= k, r.allreduce_busy /= k;
      run.ranks[rank] = r;
    }
  }
  std::string doc = doctor_json.empty() ? (fs::path(dir) / "doctor.json").string() : doctor_json;
  if (std::ifstream d(doc); d) {
    auto j = nlohmann::json::parse(d, nullptr, false);
    if (!j.is_discarded()) run.doctor = j;
  }
  return run;
}

std::string render_html(const RunData& run) {
  std::ostringstream o;
  o << "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>lockstep report: " << esc(run.dir)
    << "</title><style>"
       "body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1180px;color:#222}"
       "h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}"
       "figure{display:inline-block;margin:6px}.t{font-size:13px;font-weight:600}.a{font-size:11px;fill:#555}"
       "table{border-collapse:collapse;font-variant-numeric:tabular-nums}td,th{border:1px solid "
       "#ddd;padding:2px 8px;"
       "text-align:right}th{background:#f4f4f4}.k{display:inline-block;margin-right:18px}"
       ".f{background:#fff7e6;border-left:4px solid #f28e2b;padding:6px 10px;margin:8px 0}"
       ".n{background:#eef4fb;border-left:4px solid #4e79a7;padding:6px 10px;margin:8px 0}"
       "</style></head><body>";
  o << "<h1>lockstep training report</h1><p>Run directory: <code>" << esc(run.dir) << "</code></p>";
  if (!run.begin.is_null()) {
    o << "<p>";
    for (const char* key :
         {"world_size", "per_device_train_batch_size", "gradient_accumulation_steps", "intra_op_threads",
          "cores", "backend", "ddp_comm_hook", "parameters", "max_steps"})
      if (run.begin.contains(key))
        o << "<span class='k'>" << key << ": <b id='cfg-" << key << "'>"
          << esc(run.begin[key].is_string() ? run.begin[key].get<std::string>() : run.begin[key].dump())
          << "</b></span>";
    o << "</p>";
  }

  // Summary figures.
  double total_samples_rate = 0, exposed = 0;
  for (const auto& e : run.logs)
    total_samples_rate += e.value("samples_per_second", 0.0),
        exposed += e.value("exposed_comm_fraction", 0.0);
  if (!run.logs.empty()) {
    const auto& last = run.logs.back();
    o << "<p><span class='k'>steps: <b id='sum-steps'>" << last.value("step", 0) << "</b></span>"
      << "<span class='k'>last loss: <b id='sum-loss'>" << num(last.value("loss", 0.0), "%.4f")
      << "</b></span>"
      << "<span class='k'>mean samples/s: <b id='sum-sps'>"
      << num(total_samples_rate / run.logs.size(), "%.0f")
      << "</b></span><span class='k'>mean exposed communication: <b id='sum-exposed'>"
      << num(100 * exposed / run.logs.size(), "%.1f") << "%</b></span>";
    if (!run.evals.empty())
      o << "<span class='k'>last eval accuracy: <b id='sum-acc'>"
        << num(run.evals.back().value("eval_accuracy", 0.0), "%.4f") << "</b></span>";
    o << "</p>";
  }

  o << "<h2>Loss and evaluation</h2>";
  Series loss{"train loss", "#4e79a7", {}}, eval_loss{"eval loss", "#e15759", {}},
      acc{"eval accuracy", "#59a14f", {}};
  for (const auto& e : run.logs) loss.points.emplace_back(e.value("step", 0.0), e.value("loss", 0.0));
  for (const auto& e : run.evals) {
    eval_loss.points.emplace_back(e.value("step", 0.0), e.value("eval_loss", 0.0));
    acc.points.emplace_back(e.value("step", 0.0), e.value("eval_accuracy", 0.0));
  }
  o << chart("loss", {loss, eval_loss}, "optimiser step", "loss", true);
  o << chart("eval accuracy", {acc}, "optimiser step", "accuracy");

  o << "<h2>Throughput and communication</h2>";
  Series sps{"samples/s", "#4e79a7", {}}, exp{"exposed comm %", "#e15759", {}};
  for (const auto& e : run.logs) {
    sps.points.emplace_back(e.value("step", 0.0), e.value("samples_per_second", 0.0));
    exp.points.emplace_back(e.value("step", 0.0), 100 * e.value("exposed_comm_fraction", 0.0));
  }
  o << chart("throughput", {sps}, "optimiser step", "samples/s (all workers)", true);
  o << chart("exposed communication", {exp}, "optimiser step", "% of the step", true);

  o << "<h2>Where a step's time goes</h2>";
  std::vector<std::pair<std::string, std::vector<double>>> rows;
  if (!run.ranks.empty()) {
    for (const auto& [rank, r] : run.ranks)
      rows.push_back(
          {"rank " + std::to_string(rank), {r.data, r.forward, r.backward, 0.0, r.optimizer, 0.0}});
    o << "<p>Per rank, from the traces (backward includes waiting for the all-reduce):</p>";
  } else if (!run.logs.empty()) {
    std::vector<double> avg(6, 0.0);
    for (const auto& e : run.logs) {
      auto p = parts_of(e);
      for (int k = 0; k < 6; ++k)
        avg[static_cast<std::size_t>(k)] += p[static_cast<std::size_t>(k)] / run.logs.size();
    }
    rows.push_back({"all ranks", avg});
    o << "<p>Averaged over ranks (run with <code>--trace</code> for a bar per rank):</p>";
  }
  o << stacked(rows);
  if (!run.ranks.empty()) {
    o << "<table><tr><th>rank</th><th>steps</th><th>data ms</th><th>forward ms</th><th>backward "
         "ms</th><th>optimizer "
         "ms</th><th>all-reduce busy ms</th></tr>";
    for (const auto& [rank, r] : run.ranks)
      o << "<tr data-rank='" << rank << "'><td>" << rank << "</td><td>" << r.steps << "</td><td>"
        << num(r.data * 1e3, "%.2f") << "</td><td>" << num(r.forward * 1e3, "%.2f") << "</td><td>"
        << num(r.backward * 1e3, "%.2f") << "</td><td>" << num(r.optimizer * 1e3, "%.2f") << "</td><td>"
        << num(r.allreduce_busy * 1e3, "%.2f") << "</td></tr>";
    o << "</table>";
  }

  if (!run.doctor.is_null()) {
    o << "<h2>lockstep doctor</h2><p>Scaling efficiency <b id='doc-eff'>"
      << num(100 * run.doctor.value("scaling_efficiency", 0.0), "%.0f") << "%</b> ("
      << run.doctor["many"].value("world_size", 0) << " workers vs 1); all-reduce inside training "
      << num(run.doctor.value("training_gbps", 0.0), "%.2f") << " GB/s, lockstep bench "
      << num(run.doctor.value("bench_gbps", 0.0), "%.2f") << " GB/s.</p>";
    std::vector<std::pair<std::string, std::vector<double>>> drows;
    for (const char* side : {"one", "many"}) {
      const auto& s = run.doctor[side];
      drows.push_back({std::to_string(s.value("world_size", 0)) + " worker(s)",
                       {s.value("data_seconds", 0.0), s.value("forward_seconds", 0.0),
                        s.value("backward_seconds", 0.0), s.value("exposed_comm_seconds", 0.0),
                        s.value("optimizer_seconds", 0.0), s.value("other_seconds", 0.0)}});
    }
    o << stacked(drows);
    int n = 0;
    for (const auto& f : run.doctor["findings"]) {
      bool rec = f.value("recommendation", true);
      o << "<div class='" << (rec ? "f" : "n") << "'>" << (rec ? std::to_string(++n) + ". " : "note: ")
        << esc(f.value("problem", "")) << "<br>&rarr; " << esc(f.value("action", ""));
      if (!f.value("predicted", "").empty())
        o << "<br><i>predicted: " << esc(f.value("predicted", "")) << "</i>";
      o << "</div>";
    }
    if (n == 0) o << "<p id='doc-none'>No problem found.</p>";
  }

  o << "<h2>Logged steps</h2><table id='steps'><tr><th>step</th><th>epoch</th><th>loss</th><th>learning "
       "rate</th>"
       "<th>samples/s</th><th>exposed comm %</th><th>step ms</th></tr>";
  for (const auto& e : run.logs)
    o << "<tr data-step='" << e.value("step", 0) << "'><td>" << e.value("step", 0) << "</td><td>"
      << num(e.value("epoch", 0.0), "%.2f") << "</td><td>" << num(e.value("loss", 0.0), "%.4f") << "</td><td>"
      << num(e.value("learning_rate", 0.0), "%.3g") << "</td><td>"
      << num(e.value("samples_per_second", 0.0), "%.0f") << "</td><td>"
      << num(100 * e.value("exposed_comm_fraction", 0.0), "%.1f") << "</td><td>"
      << num(1e3 * e.value("step_seconds", 0.0), "%.1f") << "</td></tr>";
  o << "</table>";
  if (!run.evals.empty()) {
    o << "<h2>Evaluations</h2><table id='evals'><tr><th>step</th><th>eval loss</th><th>eval accuracy</th>"
         "<th>samples</th></tr>";
    for (const auto& e : run.evals)
      o << "<tr data-eval-step='" << e.value("step", 0) << "'><td>" << e.value("step", 0) << "</td><td>"
        << num(e.value("eval_loss", 0.0), "%.4f") << "</td><td>" << num(e.value("eval_accuracy", 0.0), "%.4f")
        << "</td><td>" << e.value("eval_samples", 0) << "</td></tr>";
    o << "</table>";
  }
  o << "<p style='color:#888'>Written by lockstep report from metrics.jsonl"
    << (run.ranks.empty() ? "" : ", trace/") << (run.doctor.is_null() ? "" : ", doctor.json")
    << ".</p></body></html>\n";
  return o.str();
}

std::string write_report(const std::string& dir, const std::string& output, const std::string& doctor_json) {
  RunData run = load_run(dir, doctor_json);
  std::string path = output.empty() ? (fs::path(dir) / "report.html").string() : output;
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << render_html(run);
    if (!out) throw Error("cannot write " + tmp);
  }
  fs::rename(tmp, path);
  return path;
}

}  // namespace lockstep::tools
