#include "lockstep/doctor/report.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "lockstep/error.h"
#include "lockstep/train_core/durable_file.h"
#include "svg.h"

namespace fs = std::filesystem;

namespace lockstep::doctor {
namespace {

namespace metrics = train::metrics;
using svg::esc;
using svg::num;

// Per-step times of one rank from its Chrome trace (the span names the Trainer writes).
std::optional<RankTimes> rank_times(const fs::path& trace_file) {
  std::ifstream t(trace_file);
  auto events = nlohmann::json::parse(t, nullptr, false);
  if (events.is_discarded() || !events.is_array()) return std::nullopt;  // a run still writing it
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
  if (r.steps == 0) return std::nullopt;
  const double k = r.steps;
  r.data /= k, r.forward /= k, r.backward /= k, r.optimizer /= k, r.allreduce_busy /= k;
  return r;
}

std::map<int, RankTimes> read_traces(const fs::path& dir) {
  std::map<int, RankTimes> ranks;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir / "trace", ec)) {
    int rank = -1;
    if (std::sscanf(entry.path().filename().c_str(), "rank_%d.json", &rank) != 1) continue;
    if (auto r = rank_times(entry.path())) ranks[rank] = *r;
  }
  return ranks;
}

std::optional<DoctorRecord> read_doctor(const std::string& path) {
  std::ifstream d(path);
  if (!d) return std::nullopt;
  auto j = nlohmann::json::parse(d, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  DoctorRecord r;
  r.evidence.one = RunSummary::from_json(j.value("one", nlohmann::json::object()));
  r.evidence.many = RunSummary::from_json(j.value("many", nlohmann::json::object()));
  r.evidence.bench_gbps = j.value("bench_gbps", 0.0);
  r.scaling_efficiency = j.value("scaling_efficiency", 0.0);
  r.training_gbps = j.value("training_gbps", 0.0);
  for (const auto& f : j.value("findings", nlohmann::json::array()))
    r.findings.push_back(Finding::from_json(f));
  return r;
}

// The parts of a logged step, in svg::stacked's order.
std::vector<double> parts_of(const metrics::StepLog& e) {
  return {e.data_seconds,
          e.forward_seconds,
          e.backward_seconds,
          e.exposed_comm_seconds,
          e.optimizer_seconds,
          std::max(0.0, e.step_seconds - e.data_seconds - e.forward_seconds - e.backward_seconds -
                            e.exposed_comm_seconds - e.optimizer_seconds)};
}

std::vector<double> parts_of(const RunSummary& s) {
  return {s.data, s.forward, s.backward, s.exposed, s.optimizer, s.other()};
}

void head(std::ostream& o, const RunData& run) {
  o << "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>lockstep report: " << esc(run.dir)
    << "</title><style>"
       "body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1180px;color:#222}"
       "h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}"
       "figure{display:inline-block;margin:6px}.t{font-size:13px;font-weight:600}.a{font-size:11px;fill:#555}"
       "table{border-collapse:collapse;font-variant-numeric:tabular-nums}td,th{border:1px solid #ddd;"
       "padding:2px 8px;text-align:right}th{background:#f4f4f4}.k{display:inline-block;margin-right:18px}"
       ".f{background:#fff7e6;border-left:4px solid #f28e2b;padding:6px 10px;margin:8px 0}"
       ".n{background:#eef4fb;border-left:4px solid #4e79a7;padding:6px 10px;margin:8px 0}"
       "</style></head><body>";
  o << "<h1>lockstep training report</h1><p>Run directory: <code>" << esc(run.dir) << "</code></p>";
}

// Every field of the first train_begin line, as written.
void configuration(std::ostream& o, const RunData& run) {
  if (!run.begin) return;
  const nlohmann::json begin = run.begin->to_json();
  o << "<p>";
  for (const auto& [key, value] : begin.items()) {
    if (key == "event") continue;
    o << "<span class='k'>" << esc(key) << ": <b id='cfg-" << esc(key) << "'>"
      << esc(value.is_string() ? value.get<std::string>() : value.dump()) << "</b></span>";
  }
  o << "</p>";
}

// A language model's run: its logs count tokens and its evaluations report perplexity.
bool per_token(const RunData& run) {
  return !run.logs.empty() && run.logs.back().tokens_per_second.has_value();
}

void summary(std::ostream& o, const RunData& run) {
  if (run.logs.empty()) return;
  double rate = 0, tokens = 0, exposed = 0;
  for (const auto& e : run.logs)
    rate += e.samples_per_second, tokens += e.tokens_per_second.value_or(0), exposed += e.exposed_comm_fraction;
  const double n = static_cast<double>(run.logs.size());
  o << "<p><span class='k'>steps: <b id='sum-steps'>" << run.logs.back().step << "</b></span>"
    << "<span class='k'>last loss: <b id='sum-loss'>" << num(run.logs.back().loss, "%.4f") << "</b></span>"
    << "<span class='k'>mean samples/s: <b id='sum-sps'>" << num(rate / n, "%.0f") << "</b></span>";
  if (per_token(run))
    o << "<span class='k'>mean tokens/s: <b id='sum-tps'>" << num(tokens / n, "%.0f") << "</b></span>";
  o << "<span class='k'>mean exposed communication: <b id='sum-exposed'>" << num(100 * exposed / n, "%.1f")
    << "%</b></span>";
  if (!run.evals.empty())
    o << "<span class='k'>last eval accuracy: <b id='sum-acc'>" << num(run.evals.back().eval_accuracy, "%.4f")
      << "</b></span>";
  if (!run.evals.empty() && run.evals.back().eval_perplexity)
    o << "<span class='k'>last eval perplexity: <b id='sum-ppl'>"
      << num(*run.evals.back().eval_perplexity, "%.3f") << "</b></span>";
  o << "</p>";
}

void curves(std::ostream& o, const RunData& run) {
  svg::Series loss{"train loss", "#4e79a7", {}}, eval_loss{"eval loss", "#e15759", {}},
      acc{"eval accuracy", "#59a14f", {}}, sps{per_token(run) ? "tokens/s" : "samples/s", "#4e79a7", {}},
      exp{"exposed comm %", "#e15759", {}};
  for (const auto& e : run.logs) {
    const double x = static_cast<double>(e.step);
    loss.points.emplace_back(x, e.loss);
    sps.points.emplace_back(x, per_token(run) ? e.tokens_per_second.value_or(0) : e.samples_per_second);
    exp.points.emplace_back(x, 100 * e.exposed_comm_fraction);
  }
  for (const auto& e : run.evals) {
    eval_loss.points.emplace_back(static_cast<double>(e.step), e.eval_loss);
    acc.points.emplace_back(static_cast<double>(e.step), e.eval_accuracy);
  }
  o << "<h2>Loss and evaluation</h2>";
  o << svg::chart("loss", {loss, eval_loss}, "optimiser step", "loss", true);
  o << svg::chart("eval accuracy", {acc}, "optimiser step", "accuracy");
  o << "<h2>Throughput and communication</h2>";
  o << svg::chart("throughput", {sps}, "optimiser step", sps.name + " (all workers)", true);
  o << svg::chart("exposed communication", {exp}, "optimiser step", "% of the step", true);
}

// An elastic job's changes: who left or joined, why, and what the recovery cost.
void membership_table(std::ostream& o, const RunData& run) {
  if (run.membership_changes.empty()) return;
  o << "<h2>Membership changes</h2><table id='membership'><tr><th>step</th><th>membership</th><th>workers</th>"
       "<th>reason</th><th>left</th><th>joined</th><th>recovery s</th><th>agree s</th><th>rebuild s</th>"
       "<th>state s</th><th>steps lost</th></tr>";
  for (const auto& c : run.membership_changes)
    o << "<tr><td>" << c.step << "</td><td>" << c.membership << "</td><td>" << c.world_size_before << " &rarr; "
      << c.world_size << "</td><td>" << esc(c.reason) << "</td><td>" << esc(c.left) << "</td><td>"
      << esc(c.joined) << "</td><td>" << num(c.recovery_seconds, "%.3f") << "</td><td>"
      << num(c.agree_seconds, "%.3f") << "</td><td>" << num(c.rebuild_seconds, "%.3f") << "</td><td>"
      << num(c.state_seconds, "%.3f") << "</td><td>" << c.steps_lost << "</td></tr>";
  o << "</table>";
}

void rank_table(std::ostream& o, const std::map<int, RankTimes>& ranks) {
  o << "<table><tr><th>rank</th><th>steps</th><th>data ms</th><th>forward ms</th><th>backward ms</th>"
       "<th>optimizer ms</th><th>all-reduce busy ms</th></tr>";
  for (const auto& [rank, r] : ranks)
    o << "<tr data-rank='" << rank << "'><td>" << rank << "</td><td>" << r.steps << "</td><td>"
      << num(r.data * 1e3, "%.2f") << "</td><td>" << num(r.forward * 1e3, "%.2f") << "</td><td>"
      << num(r.backward * 1e3, "%.2f") << "</td><td>" << num(r.optimizer * 1e3, "%.2f") << "</td><td>"
      << num(r.allreduce_busy * 1e3, "%.2f") << "</td></tr>";
  o << "</table>";
}

void breakdown(std::ostream& o, const RunData& run) {
  o << "<h2>Where a step's time goes</h2>";
  std::vector<std::pair<std::string, std::vector<double>>> rows;
  if (!run.ranks.empty()) {
    for (const auto& [rank, r] : run.ranks)
      rows.push_back(
          {"rank " + std::to_string(rank), {r.data, r.forward, r.backward, 0.0, r.optimizer, 0.0}});
    o << "<p>Per rank, from the traces (backward includes waiting for the all-reduce):</p>";
  } else if (!run.logs.empty()) {
    std::vector<double> avg(svg::kStepParts, 0.0);
    for (const auto& e : run.logs) {
      auto p = parts_of(e);
      for (std::size_t k = 0; k < avg.size(); ++k) avg[k] += p[k] / static_cast<double>(run.logs.size());
    }
    rows.push_back({"all ranks", avg});
    o << "<p>Averaged over ranks (run with <code>--trace</code> for a bar per rank):</p>";
  }
  o << svg::stacked(rows);
  if (!run.ranks.empty()) rank_table(o, run.ranks);
}

// A pipelined run's stages: per pipeline rank, averaged over the logged windows, its compute,
// waits and sends per step, and its bubble against the schedule's with the measured times.
void pipeline_section(std::ostream& o, const RunData& run) {
  std::vector<double> compute, wait, send, bubble, analytic;
  double n = 0;
  for (const auto& e : run.logs) {
    if (!e.pipeline_bubble || !e.pipeline_compute_seconds) continue;
    auto add = [](std::vector<double>& sum, const std::optional<std::vector<double>>& v) {
      if (!v) return;
      sum.resize(std::max(sum.size(), v->size()), 0.0);
      for (std::size_t r = 0; r < v->size(); ++r) sum[r] += (*v)[r];
    };
    add(compute, e.pipeline_compute_seconds), add(wait, e.pipeline_wait_seconds), add(send, e.pipeline_send_seconds);
    add(bubble, e.pipeline_bubble), add(analytic, e.pipeline_bubble_analytic);
    ++n;
  }
  if (n == 0) return;
  o << "<h2>Pipeline stages</h2><p>Per pipeline rank, averaged over the logged windows"
    << (run.begin && run.begin->pipeline_schedule ? " (schedule <b>" + esc(*run.begin->pipeline_schedule) + "</b>)" : "")
    << ": the bubble is the share of each step a rank did not compute; the schedule's is what its table idles with "
       "the time each action took, transfers taking none.</p>"
    << "<table id='pipeline'><tr><th>pipeline rank</th><th>compute ms</th><th>waiting ms</th><th>sending ms</th>"
       "<th>bubble %</th><th>schedule's bubble %</th></tr>";
  auto at = [&](const std::vector<double>& v, std::size_t r) { return r < v.size() ? v[r] / n : 0.0; };
  for (std::size_t r = 0; r < compute.size(); ++r)
    o << "<tr data-stage='" << r << "'><td>" << r << "</td><td>" << num(1e3 * at(compute, r), "%.1f") << "</td><td>"
      << num(1e3 * at(wait, r), "%.1f") << "</td><td>" << num(1e3 * at(send, r), "%.1f") << "</td><td>"
      << num(100 * at(bubble, r), "%.1f") << "</td><td>" << num(100 * at(analytic, r), "%.1f") << "</td></tr>";
  o << "</table>";
}

// A run split more than one way: each parallel dimension's communication per step, averaged over
// the logged windows that have it, and its share of the step.
void dimensions_section(std::ostream& o, const RunData& run) {
  struct Dimension {
    const char* name;
    std::optional<double> metrics::StepLog::*field;
    const char* what;
    double sum = 0, step = 0;
    int windows = 0;
  };
  Dimension dims[] = {
      {"data", &metrics::StepLog::data_comm_seconds, "gradient reductions over the data replicas"},
      {"tensor", &metrics::StepLog::tensor_comm_seconds, "the split layers' collectives, on the step's path"},
      {"pipeline", &metrics::StepLog::pipeline_comm_seconds, "activations and gradients between stages"}};
  bool any = false;
  for (auto& d : dims)
    for (const auto& e : run.logs)
      if (const auto& v = e.*d.field) d.sum += *v, d.step += e.step_seconds, ++d.windows, any = true;
  if (!any) return;
  o << "<h2>Communication by dimension</h2><p>Per step, averaged over ranks and the logged windows:</p>"
    << "<table id='dimensions'><tr><th>dimension</th><th>ms per step</th><th>% of the step</th><th>what</th></tr>";
  for (const auto& d : dims) {
    if (d.windows == 0) continue;
    o << "<tr data-dimension='" << d.name << "'><td>" << d.name << "</td><td>" << num(1e3 * d.sum / d.windows, "%.1f")
      << "</td><td>" << num(d.step > 0 ? 100 * d.sum / d.step : 0, "%.1f") << "</td><td>" << d.what << "</td></tr>";
  }
  o << "</table>";
}

void doctor_section(std::ostream& o, const DoctorRecord& d) {
  o << "<h2>lockstep doctor</h2><p>Scaling efficiency <b id='doc-eff'>"
    << num(100 * d.scaling_efficiency, "%.0f") << "%</b> (" << d.evidence.many.world
    << " workers vs 1); all-reduce inside training " << num(d.training_gbps, "%.2f")
    << " GB/s, lockstep bench " << num(d.evidence.bench_gbps, "%.2f") << " GB/s.</p>";
  o << svg::stacked({{std::to_string(d.evidence.one.world) + " worker(s)", parts_of(d.evidence.one)},
                     {std::to_string(d.evidence.many.world) + " worker(s)", parts_of(d.evidence.many)}});
  int n = 0;
  for (const auto& f : d.findings) {
    o << "<div class='" << (f.recommendation ? "f" : "n") << "'>"
      << (f.recommendation ? std::to_string(++n) + ". " : "note: ") << esc(f.problem) << "<br>&rarr; "
      << esc(f.action);
    if (!f.predicted.empty()) o << "<br><i>predicted: " << esc(f.predicted) << "</i>";
    o << "</div>";
  }
  if (n == 0) o << "<p id='doc-none'>No problem found.</p>";
}

void tables(std::ostream& o, const RunData& run) {
  const bool tokens = per_token(run);
  o << "<h2>Logged steps</h2><table id='steps'><tr><th>step</th><th>epoch</th><th>loss</th>"
       "<th>learning rate</th><th>samples/s</th>"
    << (tokens ? "<th>tokens/s</th>" : "") << "<th>exposed comm %</th><th>step ms</th></tr>";
  for (const auto& e : run.logs) {
    o << "<tr data-step='" << e.step << "'><td>" << e.step << "</td><td>" << num(e.epoch, "%.2f")
      << "</td><td>" << num(e.loss, "%.4f") << "</td><td>" << num(e.learning_rate, "%.3g") << "</td><td>"
      << num(e.samples_per_second, "%.0f") << "</td>";
    if (tokens) o << "<td>" << num(e.tokens_per_second.value_or(0), "%.0f") << "</td>";
    o << "<td>" << num(100 * e.exposed_comm_fraction, "%.1f") << "</td><td>" << num(1e3 * e.step_seconds, "%.1f")
      << "</td></tr>";
  }
  o << "</table>";
  membership_table(o, run);
  if (run.evals.empty()) return;
  const bool perplexity = run.evals.back().eval_perplexity.has_value();
  o << "<h2>Evaluations</h2><table id='evals'><tr><th>step</th><th>eval loss</th><th>eval accuracy</th>"
    << (perplexity ? "<th>eval perplexity</th>" : "") << "<th>samples</th></tr>";
  for (const auto& e : run.evals) {
    o << "<tr data-eval-step='" << e.step << "'><td>" << e.step << "</td><td>" << num(e.eval_loss, "%.4f")
      << "</td><td>" << num(e.eval_accuracy, "%.4f") << "</td>";
    if (perplexity) o << "<td>" << num(e.eval_perplexity.value_or(0), "%.3f") << "</td>";
    o << "<td>" << e.eval_samples << "</td></tr>";
  }
  o << "</table>";
}

}  // namespace

RunData load_run(const std::string& dir, const std::string& doctor_json) {
  const fs::path metrics_path = fs::path(dir) / "metrics.jsonl";
  if (!fs::exists(metrics_path))
    throw ConfigError("no metrics.jsonl in " + dir + ": pass the --output-dir of a lockstep Trainer run");
  RunData run;
  run.dir = dir;
  for (auto& segment : metrics::read_metrics(metrics_path.string())) {
    if (!run.begin) run.begin = segment.begin;
    run.logs.insert(run.logs.end(), segment.logs.begin(), segment.logs.end());
    run.evals.insert(run.evals.end(), segment.evals.begin(), segment.evals.end());
    run.membership_changes.insert(run.membership_changes.end(), segment.membership_changes.begin(),
                                  segment.membership_changes.end());
  }
  run.ranks = read_traces(dir);
  run.doctor = read_doctor(doctor_json.empty() ? (fs::path(dir) / "doctor.json").string() : doctor_json);
  return run;
}

std::string render_html(const RunData& run) {
  std::ostringstream o;
  head(o, run);
  configuration(o, run);
  summary(o, run);
  curves(o, run);
  breakdown(o, run);
  pipeline_section(o, run);
  dimensions_section(o, run);
  if (run.doctor) doctor_section(o, *run.doctor);
  tables(o, run);
  o << "<p style='color:#888'>Written by lockstep report from metrics.jsonl"
    << (run.ranks.empty() ? "" : ", trace/") << (run.doctor ? ", doctor.json" : "")
    << ".</p></body></html>\n";
  return o.str();
}

std::string write_report(const std::string& dir, const std::string& output, const std::string& doctor_json) {
  RunData run = load_run(dir, doctor_json);
  const std::string path = output.empty() ? (fs::path(dir) / "report.html").string() : output;
  train::write_file_durably(path, render_html(run));
  return path;
}

}  // namespace lockstep::doctor
