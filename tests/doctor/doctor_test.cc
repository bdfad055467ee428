// lockstep doctor: the analysis on numbers whose right answer is known, then the whole command
// on real runs built to have one known problem each (and one with none).
#include "lockstep/doctor/doctor.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "lockstep/base/cpu_kernels.h"
#include "lockstep/doctor/report.h"
#include "lockstep/train_core/blas.h"
#include "testing.h"

namespace fs = std::filesystem;
using namespace lockstep::doctor;

namespace {

RunSummary healthy(int world) {
  RunSummary s;
  s.world = world;
  s.threads = 1;
  s.cores = 2;
  s.per_device = 64;
  s.backend = "shm";
  s.data = 0.0005;
  s.forward = 0.020;
  s.backward = 0.020;
  s.exposed = world > 1 ? 0.002 : 0;
  s.comm = world > 1 ? 0.004 : 0;
  s.optimizer = 0.002;
  s.step = s.data + s.forward + s.backward + s.exposed + s.optimizer;
  s.samples_per_second = world * 64 / s.step;
  s.bytes_per_step = world > 1 ? 1e6 : 0;
  s.buckets_per_step = 1;
  return s;
}

Evidence evidence(const RunSummary& one, const RunSummary& many, double bench_gbps, double blas_speedup = 0) {
  Evidence e;
  e.one = one;
  e.many = many;
  e.bench_gbps = bench_gbps;
  e.blas_speedup = blas_speedup;
  return e;
}

std::string fmt_speedup(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", x);
  return buf;
}

bool has(const std::vector<Finding>& f, const std::string& kind) {
  for (const auto& x : f)
    if (x.kind == kind && x.recommendation) return true;
  return false;
}

}  // namespace

TEST(DoctorAnalysis, AHealthyConfigurationGetsNoRecommendation) {
  auto f = diagnose(evidence(healthy(1), healthy(2), 2.0));
  for (const auto& x : f) EXPECT_FALSE(x.recommendation) << x.kind << ": " << x.problem;
  EXPECT_NE(format_report(evidence(healthy(1), healthy(2), 2.0), f).find("No problem found"),
            std::string::npos);
  EXPECT_GT(scaling_efficiency(healthy(1), healthy(2)), 0.9);
}

TEST(DoctorAnalysis, ExposedCommunicationAsksForALargerBatchWithAPrediction) {
  RunSummary one = healthy(1), many = healthy(2);
  many.exposed = 0.040;  // as long as the compute
  many.comm = 0.050;
  many.step += 0.038;
  many.samples_per_second = 2 * 64 / many.step;
  many.bytes_per_step = 50e6;
  auto f = diagnose(evidence(one, many, 0.5));
  ASSERT_FALSE(f.empty());
  EXPECT_EQ(f.front().kind, "batch");
  EXPECT_NE(f.front().action.find("--gradient-accumulation-steps"), std::string::npos) << f.front().action;
  EXPECT_NE(f.front().predicted.find("scaling efficiency"), std::string::npos);
  // 1 GB/s inside training against 0.5 in the bench: bandwidth-bound, so compression is offered.
  EXPECT_TRUE(has(f, "compression"));
}

TEST(DoctorAnalysis, SlowAllReducesInsideTrainingBlameSchedulingNotTheTransport) {
  RunSummary one = healthy(1), many = healthy(2);
  many.exposed = 0.030;
  many.comm = 0.100;  // 10 MB in 100 ms: 0.1 GB/s
  many.bytes_per_step = 10e6;
  many.step += 0.028;
  auto f = diagnose(evidence(one, many, 2.0));  // the bench moves 2 GB/s
  bool scheduling = false;
  for (const auto& x : f) scheduling |= x.kind == "scheduling";
  EXPECT_TRUE(scheduling);
  EXPECT_FALSE(has(f, "compression"));
}

// A heavy update (AdamW over a wide model) asks for ZeRO, with the update divided by the workers;
// a run that already shards is not told to.
TEST(DoctorAnalysis, AHeavyOptimizerStepAsksForZeroWithThePredictedStep) {
  RunSummary one = healthy(1), many = healthy(2);
  many.optimizer = 0.010;  // 10 ms of a ~52 ms step
  many.step += 0.008;
  many.optimizer_state_bytes = 64e6;
  auto f = diagnose(evidence(one, many, 2.0));
  ASSERT_TRUE(has(f, "zero"));
  for (const auto& x : f)
    if (x.kind == "zero") {
      EXPECT_NE(x.action.find("--zero-stage 2"), std::string::npos) << x.action;
      EXPECT_NE(x.predicted.find("10.0 ms -> 5.0 ms"), std::string::npos) << x.predicted;
    }
  many.zero_stage = 2;
  EXPECT_FALSE(has(diagnose(evidence(one, many, 2.0)), "zero"));
  EXPECT_FALSE(has(diagnose(evidence(healthy(1), healthy(2), 2.0)), "zero")) << "a light update is left alone";
}

TEST(DoctorAnalysis, OversubscribedThreadsAndDataWaitAreNamed) {
  RunSummary one = healthy(1), many = healthy(2);
  many.threads = 2;  // 2 x 2 on 2 cores
  auto f = diagnose(evidence(one, many, 0));
  ASSERT_TRUE(has(f, "threads"));
  EXPECT_NE(f.front().action.find("OMP_NUM_THREADS=1"), std::string::npos) << f.front().action;
  // Oversubscription comes first even when the exposed communication it causes is larger.
  many.exposed = 0.100;
  many.step += 0.100;
  f = diagnose(evidence(one, many, 0));
  ASSERT_TRUE(has(f, "batch"));
  EXPECT_EQ(f.front().kind, "threads");

  many = healthy(2);
  many.data = 0.030;
  many.step += 0.030;
  f = diagnose(evidence(one, many, 0));
  ASSERT_TRUE(has(f, "data"));
  EXPECT_NE(f.front().action.find("--dataloader-num-workers 1"), std::string::npos) << f.front().action;
}
// A rank whose compute is 3x the others' makes rank 0 wait at the all-reduce, which alone would
// read as exposed communication: the straggler comes first, named with its cause and ratio.
TEST(DoctorAnalysis, AStragglerComesBeforeWhatItsWaitLooksLike) {
  RunSummary one = healthy(1), many = healthy(2);
  many.exposed = 0.040;  // rank 0 waiting for rank 1
  many.comm = 0.045;
  many.step += 0.038;
  many.samples_per_second = 2 * 64 / many.step;
  many.straggler_rank = 1;
  many.straggler = "rank 1 is the straggler: its compute makes its steps 3.0x as long as the other ranks' (median), "
                   "and every rank waits for it at the gradient all-reduce";
  const auto f = diagnose(evidence(one, many, 2.0));
  ASSERT_FALSE(f.empty());
  EXPECT_EQ(f.front().kind, "straggler");
  EXPECT_NE(f.front().action.find("rank 1's compute"), std::string::npos) << f.front().action;
  EXPECT_NE(f.front().predicted.find("3.0x"), std::string::npos) << f.front().predicted;
  EXPECT_NEAR(f.front().saving, 2.0 / 3, 1e-9);
  EXPECT_TRUE(has(f, "batch")) << "the wait is still reported, after the straggler";
  const RunSummary back = RunSummary::from_json(many.to_json());
  EXPECT_EQ(back.straggler_rank, 1);
  EXPECT_EQ(back.straggler, many.straggler);
  EXPECT_FALSE(has(diagnose(evidence(one, healthy(2), 2.0)), "straggler"));
}

// Each machine's link out, timed alone: one far slower than the fastest is named first, with the
// ratio; links within 2x of each other are not (a network that is slow everywhere is the link
// rule's business).
TEST(DoctorAnalysis, AMachineWhoseLinkOutIsFarSlowerIsNamedFirst) {
  RunSummary one = healthy(1), many = healthy(4);
  many.machines = 2;
  many.exposed = 0.100;
  many.comm = 0.110;
  many.step += 0.098;
  many.samples_per_second = 4 * 64 / many.step;
  Evidence e = evidence(one, many, 0.01);
  e.link_out_gbps = {0.127, 0.0127};
  const auto f = diagnose(e);
  ASSERT_FALSE(f.empty());
  EXPECT_EQ(f.front().kind, "slow_link");
  EXPECT_NE(f.front().problem.find("machine 1's link out carries 0.013 GB/s, 10.0x slower"), std::string::npos)
      << f.front().problem;
  EXPECT_NE(f.front().action.find("machine 1's network"), std::string::npos) << f.front().action;
  EXPECT_NE(format_report(e, f).find("machine 0 0.127 GB/s, machine 1 0.013 GB/s"), std::string::npos)
      << format_report(e, f);
  e.link_out_gbps = {0.127, 0.07};
  EXPECT_FALSE(has(diagnose(e), "slow_link"));
  e.link_out_gbps = {};
  EXPECT_FALSE(has(diagnose(e), "slow_link"));
}

TEST(DoctorAnalysis, KernelsBelowTheCpusComeFirstWithTheMeasuredSpeedup) {
  RunSummary one = healthy(1), many = healthy(2);
  for (RunSummary* s : {&one, &many}) s->blas_core = "Prescott", s->blas_best_core = "SkylakeX";
  many.data = 0.030;  // a data problem too, smaller than what the kernels cost
  many.step += 0.030;
  auto f = diagnose(evidence(one, many, 0, 3.0));
  ASSERT_TRUE(has(f, "blas"));
  EXPECT_EQ(f.front().kind, "blas");
  EXPECT_NE(f.front().action.find("OPENBLAS_CORETYPE=SkylakeX"), std::string::npos) << f.front().action;
  EXPECT_NE(f.front().predicted.find("3.0x"), std::string::npos) << f.front().predicted;
  EXPECT_TRUE(has(f, "data"));
  // Slow kernels someone chose with OPENBLAS_CORETYPE: said, with the way back.
  for (RunSummary* s : {&one, &many}) s->blas_forced = true;
  f = diagnose(evidence(one, many, 0, 3.0));
  ASSERT_TRUE(has(f, "blas"));
  EXPECT_NE(f.front().problem.find("OPENBLAS_CORETYPE chose them"), std::string::npos) << f.front().problem;
  // As good as the CPU allows, chosen or not: nothing to say.
  for (RunSummary* s : {&one, &many}) s->blas_core = "SkylakeX";
  EXPECT_FALSE(has(diagnose(evidence(one, many, 0)), "blas"));
  for (RunSummary* s : {&one, &many}) s->blas_forced = false;
  EXPECT_FALSE(has(diagnose(evidence(one, many, 0)), "blas"));
}

TEST(DoctorAnalysis, TheReportSaysWhoChoseTheKernels) {
  RunSummary one = healthy(1), many = healthy(2);
  many.blas_core = many.blas_best_core = "SkylakeX";
  many.blas_forced = many.blas_by_launcher = true;
  many.blas_own_core = "Prescott";
  auto e = evidence(one, many, 0);
  const std::string report = format_report(e, diagnose(e));
  EXPECT_NE(
      report.find("OpenBLAS's SkylakeX kernels, set by lockstep run (OpenBLAS by itself picks Prescott"),
      std::string::npos)
      << report;
  many.blas_by_launcher = false;
  e = evidence(one, many, 0);
  EXPECT_NE(format_report(e, {}).find("OpenBLAS's SkylakeX kernels, set by OPENBLAS_CORETYPE"),
            std::string::npos);
}

TEST(DoctorAnalysis, Fp32OnACpuWithBf16UnitsIsToldTheMeasuredRatesAndThePredictedStep) {
  RunSummary one = healthy(1), many = healthy(2);
  many.model_flops_per_sample = 3.2e6;  // 2 x 64 samples per 44.5 ms step: 9.2 GFLOP/s per worker
  many.matmul_fp32 = 40e9, many.matmul_bf16 = 160e9;
  auto f = diagnose(evidence(one, many, 2.0));
  ASSERT_TRUE(has(f, "precision"));
  EXPECT_EQ(f.front().kind, "precision");
  EXPECT_NE(f.front().problem.find("(4.0x)"), std::string::npos) << f.front().problem;
  EXPECT_NE(f.front().action.find("--bf16"), std::string::npos) << f.front().action;
  // 40 of the 44.5 ms are forward and backward: at 4x, 30 ms saved.
  EXPECT_NE(f.front().predicted.find(fmt_speedup(many.step / (many.step - 0.030))), std::string::npos)
      << f.front().predicted;
  const auto note = std::find_if(f.begin(), f.end(), [](const Finding& x) { return x.kind == "utilisation"; });
  ASSERT_NE(note, f.end());
  EXPECT_FALSE(note->recommendation);
  EXPECT_NE(note->problem.find(std::to_string(static_cast<int>(std::lround(100 * many.mfu()))) + "%"),
            std::string::npos)
      << note->problem;
  // Where bf16 is no faster (no bf16 units), fp32 is kept, and the note says why.
  many.matmul_bf16 = 30e9;
  f = diagnose(evidence(one, many, 2.0));
  EXPECT_FALSE(has(f, "precision"));
  const auto keep = std::find_if(f.begin(), f.end(), [](const Finding& x) { return x.kind == "utilisation"; });
  ASSERT_NE(keep, f.end());
  EXPECT_NE(keep->action.find("keep fp32"), std::string::npos) << keep->action;
  // A run in bf16 already: utilisation against the bf16 rate, nothing to advise.
  many.bf16 = true, many.matmul_bf16 = 160e9;
  EXPECT_FALSE(has(diagnose(evidence(one, many, 2.0)), "precision"));
  EXPECT_DOUBLE_EQ(many.mfu(), many.model_flops_per_worker() / 160e9);
}

// ----- the command, on real runs of the Fashion-MNIST example ---------------------------------

namespace {

struct DoctorRun {
  int code;
  std::string output;
  nlohmann::json doc;
};

DoctorRun doctor(const std::string& name, std::vector<std::string> program_flags,
                 const std::map<std::string, std::string>& env = {}, const std::string& backend = "auto") {
  lockstep::testing::TempDir out_dir(name);
  const std::string out = out_dir.path();
  // The kernels: what lockstep run gives its workers (the CPU's best), unless a test says.
  const auto& environment = env;
  std::vector<std::string> argv = {LOCKSTEP_BINARY, "doctor", "--steps",      "24", "--window", "8",
                                   "--backend",     backend,  "--output-dir", out,  "--",       FASHION_MNIST,
                                   "--train-limit", "8192"};
  argv.insert(argv.end(), program_flags.begin(), program_flags.end());
  lockstep::testing::Process p(argv, environment);
  DoctorRun r;
  r.code = p.wait(300);
  r.output = p.output();
  std::ifstream in(out + "/doctor.json");
  if (in) r.doc = nlohmann::json::parse(in);
  return r;
}

std::string first_recommendation(const nlohmann::json& doc) {
  for (const auto& f : doc["findings"])
    if (f["recommendation"].get<bool>()) return f["kind"].get<std::string>();
  return "";
}

bool recommends(const nlohmann::json& doc, const std::string& kind) {
  for (const auto& f : doc["findings"])
    if (f["recommendation"].get<bool>() && f["kind"].get<std::string>() == kind) return true;
  return false;
}

}  // namespace

// Whether accumulation comes first depends on the host: where the update of 12.6 M parameters
// takes a third of the step (an Intel Xeon host measured 30%), sharding the optimizer rightly
// ranks above it. That accumulation is recommended holds on any host.
TEST(Doctor, AWideModelWithATinyBatchIsToldToAccumulate) {
  // 40 MB of gradients per 2 samples over TCP (gloo): the all-reduce outlasts backward.
  auto r = doctor(
      "wide",
      {"--model", "wide", "--per-device-train-batch-size", "2", "--optim", "sgd", "--sgd-momentum", "0"},
      {{"OMP_NUM_THREADS", "1"}}, "gloo");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(recommends(r.doc, "batch")) << r.output;
  EXPECT_NE(r.output.find("--gradient-accumulation-steps"), std::string::npos) << r.output;
  EXPECT_GT(r.doc["many"]["allreduce_bytes_per_step"].get<double>(), 40e6);  // 12.6 M float gradients
  EXPECT_GT(r.doc["bench_gbps"].get<double>(), 0) << r.output;
}

TEST(Doctor, OversubscribedThreadsAreToldToUseFewer) {
  // Each of the 2 workers gets as many threads as the machine has cores: twice too many.
  const int cores = static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
  auto r = doctor("threads", {"--model", "cnn"}, {{"OMP_NUM_THREADS", std::to_string(cores)}});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.doc["many"]["intra_op_threads"].get<int>(), cores);
  EXPECT_EQ(first_recommendation(r.doc), "threads") << r.output;
  EXPECT_NE(r.output.find("OMP_NUM_THREADS=" + std::to_string(std::max(1, cores / 2))), std::string::npos)
      << r.output;
}

TEST(Doctor, ASlowDatasetPointsAtDataLoading) {
  auto r = doctor("data", {"--model", "cnn", "--data-delay-ms", "60"}, {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(first_recommendation(r.doc), "data") << r.output;
  EXPECT_NE(r.output.find("--dataloader-num-workers"), std::string::npos) << r.output;
}

// Rank 1's batches load 60 ms slower than rank 0's: the doctor names rank 1 and its data, not the
// all-reduce rank 0 waits in.
TEST(Doctor, ARankWithSlowDataIsNamedAsTheStraggler) {
  auto r = doctor("straggler", {"--model", "cnn", "--data-delay-ms", "60", "--data-delay-rank", "1"},
                  {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(first_recommendation(r.doc), "straggler") << r.output;
  EXPECT_EQ(r.doc["many"]["straggler_rank"].get<int>(), 1) << r.output;
  EXPECT_NE(r.output.find("rank 1 is the straggler: its data loading"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--dataloader-num-workers"), std::string::npos) << r.output;
}

TEST(Doctor, AHealthyConfigurationIsNotGivenAnInventedProblem) {
  // OpenBLAS's kernels as lockstep run picks them: a host whose environment forces others
  // (OPENBLAS_CORETYPE) has a real problem the doctor is right to name.
  auto r = doctor("healthy", {"--model", "cnn"}, {{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_CORETYPE", "<unset>"}});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(first_recommendation(r.doc), "") << r.output;
  EXPECT_NE(r.output.find("No problem found"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("scaling efficiency"), std::string::npos) << r.output;
}

// Where this machine's OpenBLAS picks kernels below the CPU's (Debian 12's on Emerald Rapids),
// lockstep run gives the workers the best ones and the doctor says who chose them.
TEST(Doctor, KernelsOpenblasWouldPickBelowTheCpusAreReplacedAndNamed) {
  const std::string own = lockstep::openblas_own_core(), best = lockstep::train::blas_info().best_core;
  if (!lockstep::openblas_core_below(own, best))
    GTEST_SKIP() << "this machine's OpenBLAS picks the CPU's best kernels by itself (" << own << ")";
  auto r = doctor("blas", {"--model", "mlp"}, {{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_CORETYPE", "<unset>"}});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.doc["one"]["blas_core"].get<std::string>(), best);
  EXPECT_NE(first_recommendation(r.doc), "blas") << r.output;
  EXPECT_NE(r.output.find("set by lockstep run (OpenBLAS by itself picks " + own), std::string::npos)
      << r.output;
}

TEST(Doctor, AProgramThatIsNotATrainerIsAClearError) {
  lockstep::testing::TempDir out("bad");
  lockstep::testing::Process p({LOCKSTEP_BINARY, "doctor", "--output-dir", out.path(), "--", "/bin/true"});
  EXPECT_NE(p.wait(60), 0);
  EXPECT_NE(p.output().find("did not run the lockstep Trainer"), std::string::npos) << p.output();
}

// ----- lockstep report ---------------------------------------------------------------------

namespace {

std::string cell_after(const std::string& html, const std::string& row_marker, int column) {
  auto at = html.find(row_marker);
  if (at == std::string::npos) return "(no row " + row_marker + ")";
  for (int c = 0; c <= column; ++c) {
    at = html.find("<td>", at);
    if (at == std::string::npos) return "(no cell)";
    at += 4;
  }
  return html.substr(at, html.find("</td>", at) - at);
}

std::string printed(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Width and height from a PNG's IHDR chunk; {0, 0} when it is not a PNG.
std::pair<int, int> png_size(const std::string& bytes) {
  if (bytes.size() < 24 || bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0) return {0, 0};
  auto be = [&](std::size_t i) {
    return (static_cast<unsigned char>(bytes[i]) << 24) | (static_cast<unsigned char>(bytes[i + 1]) << 16) |
           (static_cast<unsigned char>(bytes[i + 2]) << 8) | static_cast<unsigned char>(bytes[i + 3]);
  };
  return {static_cast<int>(be(16)), static_cast<int>(be(20))};
}

std::string screenshot(const std::string& html_path, const std::string& png_path) {
  lockstep::testing::Process c(
      {"/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
       "--window-size=1200,2400", "--screenshot=" + png_path, "file://" + html_path},
      {{"HOME", ::testing::TempDir()}});
  EXPECT_EQ(c.wait(120), 0) << c.output();
  return lockstep::testing::read_file(png_path);
}

}  // namespace

TEST(Report, APageWithTheRunsNumbersThatRendersInABrowser) {
  ASSERT_TRUE(fs::exists("/usr/bin/chromium"))
      << "the report test needs Debian's chromium (./scripts/test installs it)";
  lockstep::testing::TempDir out_dir("report");
  const std::string out = out_dir.path();
  lockstep::testing::Process run({LOCKSTEP_BINARY,
                                  "run",
                                  "--nproc-per-node",
                                  "2",
                                  FASHION_MNIST,
                                  "--model",
                                  "mlp",
                                  "--train-limit",
                                  "2048",
                                  "--eval-limit",
                                  "500",
                                  "--max-steps",
                                  "30",
                                  "--logging-steps",
                                  "5",
                                  "--eval-strategy",
                                  "steps",
                                  "--eval-steps",
                                  "15",
                                  "--save-strategy",
                                  "no",
                                  "--trace",
                                  "--disable-tqdm",
                                  "--output-dir",
                                  out});
  ASSERT_EQ(run.wait(180), 0) << run.output();
  lockstep::testing::Process report({LOCKSTEP_BINARY, "report", out});
  ASSERT_EQ(report.wait(60), 0) << report.output();
  const std::string html = lockstep::testing::read_file(out + "/report.html");

  // The numbers on the page are the ones in metrics.jsonl.
  int logs = 0, evals = 0;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto e = nlohmann::json::parse(line);
    if (e.contains("eval_loss")) {
      std::string row = "data-eval-step='" + std::to_string(e["step"].get<int>()) + "'";
      EXPECT_EQ(cell_after(html, row, 1), printed("%.4f", e["eval_loss"].get<double>()));
      EXPECT_EQ(cell_after(html, row, 2), printed("%.4f", e["eval_accuracy"].get<double>()));
      ++evals;
    } else if (e.contains("loss")) {
      std::string row = "data-step='" + std::to_string(e["step"].get<int>()) + "'";
      EXPECT_EQ(cell_after(html, row, 2), printed("%.4f", e["loss"].get<double>())) << row;
      EXPECT_EQ(cell_after(html, row, 4), printed("%.0f", e["samples_per_second"].get<double>())) << row;
      EXPECT_EQ(cell_after(html, row, 5), printed("%.1f", 100 * e["exposed_comm_fraction"].get<double>()))
          << row;
      ++logs;
    }
  }
  EXPECT_EQ(logs, 6);
  EXPECT_EQ(evals, 2);
  EXPECT_NE(html.find("id='sum-steps'>30<"), std::string::npos);
  for (int rank : {0, 1}) {  // the per-rank breakdown came from both traces
    EXPECT_EQ(cell_after(html, "data-rank='" + std::to_string(rank) + "'", 1), "30") << rank;
  }
  // Self-contained: no scripts, no external resources.
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("href="), std::string::npos);
  EXPECT_GE(lockstep::testing::count_of(html, "<svg"), 5u);  // the charts are inline SVG

  // It renders: a real browser draws a 1200x2400 page with far more on it than a blank one.
  const std::string blank_html = out + "/blank.html";
  std::ofstream(blank_html) << "<!doctype html><html><body></body></html>\n";
  const std::string shot = screenshot(out + "/report.html", out + "/report.png");
  const std::string blank = screenshot(blank_html, out + "/blank.png");
  EXPECT_EQ(png_size(shot), std::make_pair(1200, 2400));
  EXPECT_GT(shot.size(), 5 * blank.size())
      << "report " << shot.size() << " bytes, blank page " << blank.size();
}

TEST(Report, ADirectoryWithoutMetricsIsAClearError) {
  lockstep::testing::Process p({LOCKSTEP_BINARY, "report", "/nonexistent/run"});
  EXPECT_NE(p.wait(30), 0);
  EXPECT_NE(p.output().find("no metrics.jsonl in /nonexistent/run"), std::string::npos) << p.output();
}

// Across machines, a link that is the limit gets compression; one below 100 Mbit/s also local SGD.
TEST(DoctorAnalysis, BelowAHundredMbitTheLinkFindingAlsoOffersLocalSgd) {
  for (double link_gbps : {0.1, 0.01}) {
    RunSummary many = healthy(4);
    many.machines = 2;
    many.backend = "hier";
    many.exposed = 0.030;
    many.step += 0.028;
    many.network_bytes = link_gbps * 1e9 * 0.030;
    many.network_seconds = 0.030;
    Evidence e = evidence(healthy(1), many, 2.0);
    e.bench_network_gbps = link_gbps;
    const auto findings = diagnose(e);
    ASSERT_TRUE(has(findings, "link")) << link_gbps;
    for (const auto& f : findings) {
      if (f.kind != "link") continue;
      EXPECT_NE(f.action.find("--ddp-comm-hook auto"), std::string::npos) << f.action;
      EXPECT_EQ(f.action.find("--sync-every") != std::string::npos, link_gbps < 0.0125) << link_gbps << ": " << f.action;
    }
    many.sync_every = 8;  // already local SGD: the compressing hooks do not combine with it
    EXPECT_FALSE(has(diagnose(evidence(healthy(1), many, 2.0)), "link")) << link_gbps;
  }
}

namespace {

// A 2-stage pipeline whose rank 0 idles `measured` of each step, its schedule `analytic`.
RunSummary pipelined(double measured, double analytic) {
  RunSummary s = healthy(2);
  s.pipeline = 2;
  s.pipeline_schedule = "1f1b";
  s.micro_batches = 4;
  s.bubble = {measured, measured * 0.8};
  s.bubble_analytic = {analytic, analytic * 0.8};
  return s;
}

const Finding* finding(const std::vector<Finding>& all, const std::string& kind) {
  for (const auto& f : all)
    if (f.kind == kind) return &f;
  return nullptr;
}

}  // namespace

TEST(DoctorAnalysis, APipelineBubbleNearItsSchedulesAsksForMoreMicroBatches) {
  const auto found = diagnose(evidence(healthy(1), pipelined(0.21, 0.20), 1.0));
  const Finding* f = finding(found, "pipeline");
  ASSERT_NE(f, nullptr);
  EXPECT_NE(f->problem.find("pipeline rank 0 idles 21%"), std::string::npos) << f->problem;
  EXPECT_NE(f->action.find("--num-microbatches 8"), std::string::npos) << f->action;
  EXPECT_NE(f->action.find("--pipeline-schedule zb"), std::string::npos) << f->action;
  // 1f1b at P 2: 1/5 of the step at 4 micro-batches, 1/9 at 8.
  EXPECT_NE(f->predicted.find("about 11%"), std::string::npos) << f->predicted;
}

TEST(DoctorAnalysis, APipelineBubbleFarAboveItsSchedulesBlamesTheTransfers) {
  const auto found = diagnose(evidence(healthy(1), pipelined(0.30, 0.12), 1.0));
  const Finding* f = finding(found, "pipeline");
  ASSERT_NE(f, nullptr);
  EXPECT_NE(f->action.find("transfers between stages"), std::string::npos) << f->action;
  EXPECT_NEAR(f->saving, 0.18, 1e-9);
  EXPECT_EQ(finding(diagnose(evidence(healthy(1), healthy(2), 1.0)), "pipeline"), nullptr) << "no pipeline, no finding";
}

// A pipelined run's page has a row per pipeline rank: its times per step and its bubble against
// its schedule's, averaged over the windows.
TEST(Report, APipelinedRunGetsARowPerPipelineRank) {
  RunData run;
  run.dir = "/tmp/pipelined";
  for (double b : {0.20, 0.30}) {
    lockstep::train::metrics::StepLog e;
    e.step = int(b * 100);
    e.pipeline_compute_seconds = std::vector<double>{0.4, 0.5};
    e.pipeline_wait_seconds = std::vector<double>{0.1, 0.05};
    e.pipeline_send_seconds = std::vector<double>{0.002, 0.001};
    e.pipeline_bubble = std::vector<double>{b, b / 2};
    e.pipeline_bubble_analytic = std::vector<double>{0.2, 0.1};
    run.logs.push_back(e);
  }
  const std::string page = render_html(run);
  EXPECT_NE(page.find("<tr data-stage='0'><td>0</td><td>400.0</td><td>100.0</td><td>2.0</td><td>25.0</td><td>20.0</td></tr>"),
            std::string::npos)
      << page;
  EXPECT_NE(page.find("<tr data-stage='1'><td>1</td><td>500.0</td><td>50.0</td><td>1.0</td><td>12.5</td><td>10.0</td></tr>"),
            std::string::npos);
  run.logs[0].pipeline_bubble.reset();
  run.logs[1].pipeline_bubble.reset();
  EXPECT_EQ(render_html(run).find("id='pipeline'"), std::string::npos) << "an unpipelined run has no such table";
}

// A run split two ways: a row per dimension it has, its time per step and share of the step,
// averaged over the windows that logged it.
TEST(Report, ARunSplitSeveralWaysGetsARowPerDimension) {
  RunData run;
  run.dir = "/tmp/tensor-parallel";
  for (double tensor : {0.010, 0.030}) {
    lockstep::train::metrics::StepLog e;
    e.step_seconds = 0.1;
    e.tensor_comm_seconds = tensor;
    e.data_comm_seconds = 0.005;
    run.logs.push_back(e);
  }
  const std::string page = render_html(run);
  EXPECT_NE(page.find("<tr data-dimension='tensor'><td>tensor</td><td>20.0</td><td>20.0</td>"), std::string::npos)
      << page;
  EXPECT_NE(page.find("<tr data-dimension='data'><td>data</td><td>5.0</td><td>5.0</td>"), std::string::npos);
  EXPECT_EQ(page.find("data-dimension='pipeline'"), std::string::npos) << "no pipeline, no row";
  for (auto& e : run.logs) e.tensor_comm_seconds.reset(), e.data_comm_seconds.reset();
  EXPECT_EQ(render_html(run).find("id='dimensions'"), std::string::npos) << "a run split one way has no such table";
}
