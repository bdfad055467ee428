#include "doctor.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "lockstep/error.h"
#include "lockstep/train/blas.h"

extern char** environ;

namespace fs = std::filesystem;

namespace lockstep::tools {
namespace {

std::string fmt(const char* format, double a, double b = 0, double c = 0) {
  char buf[256];
  std::snprintf(buf, sizeof buf, format, a, b, c);
  return buf;
}

std::string ms(double seconds) {
  return fmt("%.1f ms", seconds * 1e3);
}
std::string pct(double fraction) {
  return fmt("%.0f%%", fraction * 100);
}

std::string self_path() {
  char path[4096];
  ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) throw Error("cannot find the lockstep binary (/proc/self/exe)");
  return std::string(path, static_cast<std::size_t>(n));
}

// Runs argv with `env_extra` added, output to `log`; returns the exit code (128 + signal).
int run_logged(const std::vector<std::string>& argv, const std::vector<std::string>& env_extra,
               const std::string& log) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    bool replaced = false;
    for (const auto& x : env_extra)
      replaced |= kv.substr(0, kv.find('=') + 1) == x.substr(0, x.find('=') + 1);
    if (!replaced) env.push_back(kv);
  }
  env.insert(env.end(), env_extra.begin(), env_extra.end());
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : env) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, cargv[0], &fa, nullptr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw Error("cannot start " + argv[0] + ": " + std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string tail_of(const std::string& path, int lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string l; std::getline(in, l);) all.push_back(l);
  std::string out;
  for (std::size_t i =
           all.size() > static_cast<std::size_t>(lines) ? all.size() - static_cast<std::size_t>(lines) : 0;
       i < all.size(); ++i)
    out += "    | " + all[i] + "\n";
  return out;
}

}  // namespace

double Segment::other() const {
  return std::max(0.0, step - data - forward - backward - exposed - optimizer);
}

nlohmann::json Segment::to_json() const {
  return {{"world_size", world},
          {"intra_op_threads", threads},
          {"cores", cores},
          {"per_device_train_batch_size", per_device},
          {"gradient_accumulation_steps", accumulation},
          {"dataloader_num_workers", loader_workers},
          {"backend", backend},
          {"ddp_comm_hook", comm_hook},
          {"blas_core", blas_core},
          {"blas_best_core", blas_best_core},
          {"blas_forced", blas_forced},
          {"samples_per_second", samples_per_second},
          {"step_seconds", step},
          {"data_seconds", data},
          {"forward_seconds", forward},
          {"backward_seconds", backward},
          {"exposed_comm_seconds", exposed},
          {"comm_seconds", comm},
          {"optimizer_seconds", optimizer},
          {"other_seconds", other()},
          {"allreduce_bytes_per_step", bytes_per_step},
          {"buckets_per_step", buckets_per_step},
          {"windows", windows}};
}

Segment read_segment(const std::string& metrics_path) {
  std::ifstream in(metrics_path);
  if (!in)
    throw ConfigError("no metrics at " + metrics_path + ": the program did not run the lockstep Trainer?");
  Segment s;
  std::vector<nlohmann::json> windows;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) continue;
    if (j.value("event", "") == "train_begin") {
      windows.clear();  // the last run in the file counts
      s.world = j.value("world_size", 1);
      s.threads = j.value("intra_op_threads", 1);
      s.cores = j.value("cores", 1);
      s.per_device = j.value("per_device_train_batch_size", 0);
      s.accumulation = j.value("gradient_accumulation_steps", 1);
      s.loader_workers = j.value("dataloader_num_workers", 0);
      s.backend = j.value("backend", "");
      s.comm_hook = j.value("ddp_comm_hook", "none");
      s.blas_core = j.value("blas_core", "");
      s.blas_best_core = j.value("blas_best_core", "");
      s.blas_forced = j.value("blas_forced", false);
    } else if (j.contains("loss") && j.contains("step_seconds")) {
      windows.push_back(j);
    }
  }
  if (windows.size() < 2)
    throw ConfigError(metrics_path + " has " + std::to_string(windows.size()) +
                      " logged windows; the doctor needs at least 2 (the first is warm-up): raise --steps");
  auto avg = [&](const char* key) {
    double sum = 0;
    for (std::size_t i = 1; i < windows.size(); ++i) sum += windows[i].value(key, 0.0);
    return sum / static_cast<double>(windows.size() - 1);
  };
  s.samples_per_second = avg("samples_per_second");
  s.step = avg("step_seconds");
  s.data = avg("data_seconds");
  s.forward = avg("forward_seconds");
  s.backward = avg("backward_seconds");
  s.exposed = avg("exposed_comm_seconds");
  s.comm = avg("comm_seconds");
  s.optimizer = avg("optimizer_seconds");
  s.bytes_per_step = avg("allreduce_bytes_per_step");
  s.buckets_per_step = avg("buckets_per_step");
  s.windows = static_cast<int>(windows.size() - 1);
  return s;
}

double scaling_efficiency(const Segment& one, const Segment& many) {
  if (one.samples_per_second <= 0 || many.world <= 0) return 0;
  return many.samples_per_second / (static_cast<double>(many.world) * one.samples_per_second);
}

double training_gbps(const Segment& many) {
  return many.comm > 0 ? many.bytes_per_step / many.comm / 1e9 : 0;
}

std::vector<Finding> diagnose(const Segment& one, const Segment& many, double bench_gbps,
                              double blas_speedup) {
  std::vector<Finding> out;
  const double step = std::max(many.step, 1e-9);
  const double eff = scaling_efficiency(one, many);

  // Matrix products on kernels below what the CPU runs: every worker count pays it.
  if (!train::blas_advice(many.blas_core, many.blas_best_core, many.blas_forced).empty()) {
    Finding f;
    f.kind = "blas";
    f.problem = "OpenBLAS multiplies with its " + many.blas_core + " kernels, but this CPU runs its " +
                many.blas_best_core + " kernels (OpenBLAS did not recognise the CPU model)";
    f.action = "start the job with OPENBLAS_CORETYPE=" + many.blas_best_core +
               " in its environment (read when OpenBLAS loads)";
    if (blas_speedup > 0) {
      f.predicted = "measured with 1 worker: " + fmt("%.0f", one.samples_per_second) + " -> " +
                    fmt("%.0f samples/s (%.1fx)", one.samples_per_second * blas_speedup, blas_speedup);
      f.saving = std::max(0.0, 1.0 - 1.0 / blas_speedup);
    } else {
      f.predicted = "faster forward and backward; not measured";
      f.saving = 0.5 * many.compute() / step;
    }
    out.push_back(f);
  }

  // Oversubscription: a fact of the configuration, whatever the timings say.
  const int used = many.world * many.threads;
  if (used > many.cores) {
    int fit = std::max(1, many.cores / std::max(1, many.world));
    Finding f;
    f.kind = "threads";
    f.problem = std::to_string(many.world) + " workers x " + std::to_string(many.threads) +
                " intra-op threads = " + std::to_string(used) + " threads on " + std::to_string(many.cores) +
                " cores: the threads of different workers take turns on the same cores";
    f.action = "run with OMP_NUM_THREADS=" + std::to_string(fit) +
               " (lockstep run sets cores / workers when it is unset; or call torch::set_num_threads(" +
               std::to_string(fit) + "))";
    f.predicted = "compute no longer time-shared: forward+backward up to " +
                  fmt("%.1fx", static_cast<double>(used) / many.cores) + " faster per worker";
    f.saving = 1.0 - static_cast<double>(many.cores) / static_cast<double>(used);
    out.push_back(f);
  }

  // Data loading starves the step.
  const double data_share = many.data / step;
  if (data_share > 0.10) {
    const double compute = std::max(step - many.data, 1e-9);
    int workers = many.loader_workers + static_cast<int>(std::ceil(many.data / compute));
    workers = std::max(workers, many.loader_workers + 1);
    Finding f;
    f.kind = "data";
    f.problem = "each step waits " + ms(many.data) + " for its batch (" + pct(data_share) +
                " of the step) with --dataloader-num-workers " + std::to_string(many.loader_workers);
    f.action = "set --dataloader-num-workers " + std::to_string(workers) +
               " so batches are built while the model computes (or make the dataset's get() cheaper)";
    f.predicted = "step " + ms(many.step) + " -> about " +
                  ms(std::max(compute, many.data / (workers + 0.0))) + " once loading overlaps compute";
    f.saving = data_share;
    out.push_back(f);
  }

  // Communication that backward could not hide.
  const double exposed_share = many.exposed / step;
  if (many.world > 1 && exposed_share > 0.15) {
    const double per_micro = std::max(step - many.exposed - many.optimizer, 1e-9);
    const double one_micro = std::max(one.step - one.optimizer, 1e-9);
    // Accumulating k micro-batches per step leaves the per-sample compute of each side and
    // spreads the per-step costs (exposed all-reduce, optimiser) over k times more samples. The
    // efficiency tends to one_micro / per_micro; aim for 90% or near that limit, whichever is lower.
    const double limit = one_micro / per_micro;
    const double target = std::min(0.9, 0.95 * limit);
    int a = 1;
    double predicted_eff = eff;
    for (int k = 2; k <= 64; k *= 2) {
      double t_many = k * per_micro + many.optimizer + many.exposed;
      double t_one = k * one_micro + one.optimizer;
      predicted_eff = t_one / t_many;
      a = k;
      if (predicted_eff >= target) break;
    }
    Finding f;
    f.kind = "batch";
    f.problem = "backward's end waits " + ms(many.exposed) + " per step for the all-reduce (" +
                pct(exposed_share) + " of the step): " + fmt("%.1f MB", many.bytes_per_step / 1e6) +
                " of gradients per " + std::to_string(many.per_device * many.accumulation) +
                " samples per worker";
    f.action = "communicate less often per sample: --gradient-accumulation-steps " +
               std::to_string(a * many.accumulation) + " (or a per-device batch " + std::to_string(a) +
               "x larger if memory allows)";
    f.predicted = "scaling efficiency " + pct(eff) + " -> about " + pct(predicted_eff) +
                  " (the all-reduce then costs the same per " + std::to_string(a) + "x more samples)";
    if (limit < 0.9)
      f.predicted += "; beyond that, compute that is slower with " + std::to_string(many.world) +
                     " workers caps it near " + pct(limit);
    f.saving = exposed_share * (1.0 - 1.0 / a);
    out.push_back(f);

    const double got = training_gbps(many);
    if (bench_gbps > 0 && got > 0 && got < 0.5 * bench_gbps) {
      Finding s;
      s.kind = "scheduling";
      s.recommendation = false;
      s.problem = "inside training the all-reduce moved " + fmt("%.2f GB/s", got) + ", " +
                  pct(got / bench_gbps) + " of the " + fmt("%.2f GB/s", bench_gbps) +
                  " lockstep bench gets for the same bucket size on " + many.backend +
                  ": the transport is not the limit, the all-reduce competes with backward for the cores";
      s.action = "keep workers x threads below the core count so the communication thread has a core";
      s.predicted = "up to " + fmt("%.1fx", bench_gbps / got) + " faster all-reduces";
      s.saving = exposed_share * 0.5;
      out.push_back(s);
    } else if (many.comm_hook == "none") {
      Finding c;
      c.kind = "compression";
      c.problem = "the all-reduce runs near the transport's speed (" + fmt("%.2f GB/s", got) +
                  (bench_gbps > 0 ? ", bench " + fmt("%.2f GB/s", bench_gbps) : std::string()) +
                  "): it is bandwidth-bound";
      c.action = "send bf16 gradients: --ddp-comm-hook bf16 (summed in float32, rounded once)";
      c.predicted =
          "half the bytes: exposed communication about " + ms(many.exposed) + " -> " + ms(many.exposed / 2);
      c.saving = exposed_share * 0.5;
      out.push_back(c);
    }
  }

  // Compute itself slowed down with more workers: a note (shared memory bandwidth, cores).
  const double one_compute = one.compute();
  if (one_compute > 0 && many.compute() > 1.35 * one_compute) {
    Finding n;
    n.kind = "compute";
    n.recommendation = false;
    n.problem = "forward+backward take " + ms(many.compute()) + " per step with " +
                std::to_string(many.world) + " workers against " + ms(one_compute) +
                " with one: the workers share memory bandwidth and caches";
    n.action =
        "nothing in lockstep changes this; fewer, larger workers or a larger batch use the cores better";
    n.predicted = "";
    n.saving = 0;
    out.push_back(n);
  }
  // Notes after recommendations; oversubscription first (it distorts every other number), then
  // by predicted saving.
  std::stable_sort(out.begin(), out.end(), [](const Finding& x, const Finding& y) {
    if (x.recommendation != y.recommendation) return x.recommendation;
    if ((x.kind == "threads") != (y.kind == "threads")) return x.kind == "threads";
    return x.saving > y.saving;
  });
  return out;
}

std::string format_report(const Segment& one, const Segment& many, double bench_gbps,
                          const std::vector<Finding>& findings) {
  std::ostringstream os;
  os << "lockstep doctor: 1 worker vs " << many.world << " workers (" << many.threads << " intra-op thread"
     << (many.threads == 1 ? "" : "s") << " each, " << many.cores << " cores, backend " << many.backend
     << ", per-device batch " << many.per_device << " x " << many.accumulation << " accumulation)\n\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-26s %12s %12s\n", "per step", "1 worker",
                std::to_string(many.world).append(" workers").c_str());
  os << line;
  auto row = [&](const char* name, double a, double b) {
    std::snprintf(line, sizeof line, "  %-26s %9.1f ms %9.1f ms\n", name, a * 1e3, b * 1e3);
    os << line;
  };
  row("data wait", one.data, many.data);
  row("forward", one.forward, many.forward);
  row("backward compute", one.backward, many.backward);
  row("exposed communication", one.exposed, many.exposed);
  row("optimizer", one.optimizer, many.optimizer);
  row("other", one.other(), many.other());
  row("step", one.step, many.step);
  std::snprintf(line, sizeof line, "  %-26s %12.0f %12.0f\n", "samples/s", one.samples_per_second,
                many.samples_per_second);
  os << line;
  os << "  scaling efficiency: " << pct(scaling_efficiency(one, many)) << " (" << many.world
     << "-worker samples/s over " << many.world << " x 1-worker samples/s)\n";
  if (many.world > 1) {
    os << "  all-reduce inside training: " << fmt("%.1f MB", many.bytes_per_step / 1e6) << " per step in "
       << fmt("%.1f", many.buckets_per_step) << " buckets, " << ms(many.comm) << " busy, "
       << fmt("%.2f GB/s", training_gbps(many));
    if (bench_gbps > 0) os << "; lockstep bench, same bytes and backend: " << fmt("%.2f GB/s", bench_gbps);
    os << "\n";
  }
  os << "\n";
  int n = 0;
  for (const auto& f : findings) {
    if (!f.recommendation) continue;
    os << ++n << ". " << f.problem << "\n   -> " << f.action << "\n";
    if (!f.predicted.empty()) os << "   predicted: " << f.predicted << "\n";
  }
  if (n == 0) os << "No problem found: nothing in the breakdown calls for a change.\n";
  for (const auto& f : findings) {
    if (f.recommendation) continue;
    os << "note: " << f.problem << "\n   (" << f.action << ")\n";
  }
  return os.str();
}

nlohmann::json findings_json(const Segment& one, const Segment& many, double bench_gbps,
                             const std::vector<Finding>& findings) {
  nlohmann::json f = nlohmann::json::array();
  for (const auto& x : findings)
    f.push_back({{"kind", x.kind},
                 {"problem", x.problem},
                 {"action", x.action},
                 {"predicted", x.predicted},
                 {"saving", x.saving},
                 {"recommendation", x.recommendation}});
  return {{"one", one.to_json()},
          {"many", many.to_json()},
          {"scaling_efficiency", scaling_efficiency(one, many)},
          {"training_gbps", training_gbps(many)},
          {"bench_gbps", bench_gbps},
          {"findings", f}};
}

int run_doctor(const DoctorOptions& o) {
  if (o.nproc < 2)
    throw ConfigError("--nproc-per-node must be at least 2: the doctor compares 1 worker with N");
  if (o.steps < 2 * o.window || o.window < 1)
    throw ConfigError("--steps must be at least twice --window (the first window is warm-up)");
  const std::string self = self_path();
  std::vector<std::string> program = o.program;
  if (program.empty()) {
    fs::path example = fs::path(self).parent_path().parent_path() / "examples" / "fashion_mnist";
    if (!fs::exists(example))
      throw ConfigError("no program given and no Fashion-MNIST example at " + example.string() +
                        ": pass your Trainer program after --, e.g. lockstep doctor -- ./train --its-flags");
    program = {example.string(), "--model", "cnn"};
  }
  std::string dir = o.output_dir;
  if (dir.empty()) {
    char tmpl[] = "/tmp/lockstep-doctor-XXXXXX";
    if (!::mkdtemp(tmpl)) throw Error("cannot create a directory under /tmp");
    dir = tmpl;
  }
  fs::create_directories(dir);
  // The same threads per worker in both runs, so the comparison isolates distribution costs.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::string> env;
  if (!std::getenv("OMP_NUM_THREADS"))
    env.push_back("OMP_NUM_THREADS=" + std::to_string(std::max(1, cores / o.nproc)));

  // One measured segment of the program under `lockstep run`, its outputs in `out`.
  auto segment_argv = [&](int world, const std::string& out) {
    fs::remove_all(out);
    std::vector<std::string> argv = {self, "run", "--nproc-per-node", std::to_string(world)};
    if (o.backend != "auto") argv.insert(argv.end(), {"--backend", o.backend});
    argv.insert(argv.end(), program.begin(), program.end());
    argv.insert(argv.end(), {"--max-steps", std::to_string(o.steps), "--logging-steps",
                             std::to_string(o.window), "--save-strategy", "no", "--eval-strategy", "no",
                             "--early-stopping-patience", "0", "--disable-tqdm", "--output-dir", out});
    return argv;
  };

  Segment seg[2];
  const int worlds[2] = {1, o.nproc};
  for (int i = 0; i < 2; ++i) {
    const std::string out = dir + "/workers_" + std::to_string(worlds[i]);
    auto argv = segment_argv(worlds[i], out);
    std::fprintf(stderr, "lockstep doctor: measuring %d worker%s (%d steps)...\n", worlds[i],
                 worlds[i] == 1 ? "" : "s", o.steps);
    const std::string log = dir + "/workers_" + std::to_string(worlds[i]) + ".log";
    int rc = run_logged(argv, env, log);
    if (rc != 0)
      throw Error("the " + std::to_string(worlds[i]) + "-worker run failed (exit " + std::to_string(rc) +
                  "); its last lines:\n" + tail_of(log, 15));
    seg[i] = read_segment(out + "/metrics.jsonl");
  }

  // OpenBLAS below the CPU's best kernels: measure what the fix gives, on 1 worker.
  double blas_speedup = 0;
  if (!train::blas_advice(seg[0].blas_core, seg[0].blas_best_core, seg[0].blas_forced).empty()) {
    const std::string out = dir + "/workers_1_" + seg[0].blas_best_core;
    auto argv = segment_argv(1, out);
    auto env_fast = env;
    env_fast.push_back("OPENBLAS_CORETYPE=" + seg[0].blas_best_core);
    std::fprintf(stderr, "lockstep doctor: measuring 1 worker with OPENBLAS_CORETYPE=%s (%d steps)...\n",
                 seg[0].blas_best_core.c_str(), o.steps);
    if (run_logged(argv, env_fast, out + ".log") == 0 && seg[0].samples_per_second > 0)
      blas_speedup = read_segment(out + "/metrics.jsonl").samples_per_second / seg[0].samples_per_second;
  }

  double bench = 0;
  if (seg[1].bytes_per_step > 0 && seg[1].buckets_per_step > 0) {
    std::size_t bytes = static_cast<std::size_t>(seg[1].bytes_per_step / seg[1].buckets_per_step);
    bytes = std::max<std::size_t>(4096, bytes / 4 * 4);
    std::vector<std::string> argv = {self,
                                     "bench",
                                     "allreduce",
                                     "--nproc",
                                     std::to_string(o.nproc),
                                     "--backend",
                                     seg[1].backend,
                                     "--min-bytes",
                                     std::to_string(bytes),
                                     "--max-bytes",
                                     std::to_string(bytes),
                                     "--op",
                                     "avg",
                                     "--json"};
    std::fprintf(stderr, "lockstep doctor: lockstep bench allreduce on %s, %zu bytes...\n",
                 seg[1].backend.c_str(), bytes);
    const std::string log = dir + "/bench.log";
    if (run_logged(argv, env, log) == 0) {
      std::ifstream in(log);
      std::string text, l;
      while (std::getline(in, l)) {
        auto p = l.find("] ");
        text += (l.rfind("[rank", 0) == 0 && p != std::string::npos ? l.substr(p + 2) : l) + "\n";
      }
      auto start = text.find('{');
      auto j = nlohmann::json::parse(start == std::string::npos ? "" : text.substr(start), nullptr, false);
      if (!j.is_discarded() && j.contains("rows") && !j["rows"].empty())
        bench = j["rows"][0].value("algbw_gbps", 0.0);
    }
  }
  auto findings = diagnose(seg[0], seg[1], bench, blas_speedup);
  std::printf("%s", format_report(seg[0], seg[1], bench, findings).c_str());
  std::ofstream(dir + "/doctor.json") << findings_json(seg[0], seg[1], bench, findings).dump(2) << "\n";
  std::printf("\n(runs and doctor.json in %s)\n", dir.c_str());
  return 0;
}

}  // namespace lockstep::tools
