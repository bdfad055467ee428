// lockstep doctor's driver: runs the measured segments and the bench as child processes,
// then prints what diagnose() found.
#include "lockstep/doctor/doctor.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "lockstep/base/cpu_kernels.h"
#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/error.h"

namespace fs = std::filesystem;

namespace lockstep::doctor {
namespace {

std::string fmt(const char* format, double a) {
  char buf[256];
  std::snprintf(buf, sizeof buf, format, a);
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
  if (n <= 0) throw SystemError("cannot find the lockstep binary (/proc/self/exe)");
  return std::string(path, static_cast<std::size_t>(n));
}

// Runs argv with `env_extra` added (NAME=value), output to `log`; returns the exit code (128 +
// signal).
int run_logged(const std::vector<std::string>& argv, const knobs::Environment& env_extra,
               const std::string& log) {
  knobs::Environment env = knobs::environment();
  for (const auto& [k, v] : env_extra) env[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : env_strings) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, cargv[0], &fa, nullptr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw SystemError("cannot start " + argv[0] + ": " + std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string tail_of(const std::string& path, std::size_t lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string l; std::getline(in, l);) all.push_back(l);
  std::string out;
  for (std::size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i)
    out += "    | " + all[i] + "\n";
  return out;
}

// The doctor's workspace: the program it measures, where the runs go, and the environment
// every run gets (the same threads per worker in both, so the comparison isolates the costs
// of distribution).
struct Session {
  DoctorOptions options;
  std::string self;
  std::vector<std::string> program;
  std::string dir;
  knobs::Environment env;

  bool several_machines() const { return options.nnodes > 1; }
  bool reports() const { return options.node_rank == 0; }

  // `lockstep run` for `workers` per machine; across every machine of the job when `across`.
  std::vector<std::string> launcher_argv(int workers, bool across, const std::string& purpose) const {
    std::vector<std::string> argv = {self, "run", "--nproc-per-node", std::to_string(workers)};
    if (across && several_machines())
      argv.insert(argv.end(),
                  {"--nnodes", std::to_string(options.nnodes), "--node-rank",
                   std::to_string(options.node_rank), "--master-addr", options.master_addr, "--master-port",
                   std::to_string(options.master_port), "--run-id", "doctor-" + purpose,
                   // machine 0 measures its baseline first: the others wait for it
                   "--join-timeout", "900"});
    if (options.backend != "auto") argv.insert(argv.end(), {"--backend", options.backend});
    return argv;
  }

  // One measured segment of the program under `lockstep run`, its outputs in `out`.
  std::vector<std::string> segment_argv(int world, const std::string& out) const {
    fs::remove_all(out);
    std::vector<std::string> argv = launcher_argv(world, world > 1, "workers-" + std::to_string(world));
    argv.insert(argv.end(), program.begin(), program.end());
    argv.insert(argv.end(), {"--max-steps", std::to_string(options.steps), "--logging-steps",
                             std::to_string(options.window), "--save-strategy", "no", "--eval-strategy", "no",
                             "--early-stopping-patience", "0", "--disable-tqdm", "--output-dir", out});
    return argv;
  }
};

Session open_session(const DoctorOptions& o) {
  if (o.nproc < 2)
    throw ConfigError("--nproc-per-node must be at least 2: the doctor compares 1 worker with N");
  if (o.steps < 2 * o.window || o.window < 1)
    throw ConfigError("--steps must be at least twice --window (the first window is warm-up)");
  Session s;
  s.options = o;
  s.self = self_path();
  s.program = o.program;
  if (s.program.empty()) {
    fs::path example = fs::path(s.self).parent_path().parent_path() / "examples" / "fashion_mnist";
    if (!fs::exists(example))
      throw ConfigError("no program given and no Fashion-MNIST example at " + example.string() +
                        ": pass your Trainer program after --, e.g. lockstep doctor -- ./train --its-flags");
    s.program = {example.string(), "--model", "cnn"};
  }
  s.dir = o.output_dir;
  if (s.dir.empty()) {
    char tmpl[] = "/tmp/lockstep-doctor-XXXXXX";
    if (!::mkdtemp(tmpl)) throw SystemError("cannot create a directory under /tmp");
    s.dir = tmpl;
  }
  fs::create_directories(s.dir);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!knobs::is_set(knobs::kOmpNumThreads))
    s.env[knobs::kOmpNumThreads.name] = std::to_string(std::max(1, cores / o.nproc));
  s.env[knobs::kProbeMatmul.name] = "1";  // the machine's matmul rate at the model's shapes, for utilisation
  return s;
}

RunSummary measure(const Session& s, int world) {
  const std::string out = s.dir + "/workers_" + std::to_string(world);
  LOCKSTEP_LOG(info, doctor) << "measuring " << world << " worker" << (world == 1 ? "" : "s")
                             << (world > 1 && s.several_machines() ? " per machine" : "") << " ("
                             << s.options.steps << " steps)...";
  const std::string log = out + ".log";
  const int rc = run_logged(s.segment_argv(world, out), s.env, log);
  if (rc != 0)
    throw Error("the " + std::to_string(world) + "-worker run failed (exit " + std::to_string(rc) +
                "); its last lines:\n" + tail_of(log, 15));
  if (!s.reports()) return {};  // rank 0, on machine 0, wrote the metrics
  return read_summary(out + "/metrics.jsonl");
}

// OpenBLAS below the CPU's best kernels: what the fix gives, measured on 1 worker.
double measure_blas_speedup(const Session& s, const RunSummary& one) {
  if (!openblas_core_below(one.blas_core, one.blas_best_core)) return 0;
  const std::string out = s.dir + "/workers_1_" + one.blas_best_core;
  auto env = s.env;
  env[knobs::kOpenblasCoretype.name] = one.blas_best_core;
  LOCKSTEP_LOG(info, doctor) << "measuring 1 worker with OPENBLAS_CORETYPE=" << one.blas_best_core << " ("
                             << s.options.steps << " steps)...";
  if (run_logged(s.segment_argv(1, out), env, out + ".log") != 0 || one.samples_per_second <= 0) return 0;
  return read_summary(out + "/metrics.jsonl").samples_per_second / one.samples_per_second;
}

constexpr std::size_t kLinkProbeBytes = 16u << 20;

struct BenchFigures {
  double gbps = 0, network_gbps = 0;
  std::vector<double> link_out_gbps;  // by machine (several machines only)
};

// The bucket size lockstep bench measures on one machine: the run's average bucket.
std::size_t bench_bytes(const RunSummary& many) {
  if (many.bytes_per_step <= 0 || many.buckets_per_step <= 0) return 0;
  const auto bytes = static_cast<std::size_t>(many.bytes_per_step / many.buckets_per_step);
  return std::max<std::size_t>(4096, bytes / 4 * 4);
}

// lockstep bench allreduce of `bytes` on `backend`, across every machine of the job.
BenchFigures measure_bench(const Session& s, const std::string& backend, std::size_t bytes) {
  if (bytes == 0) return {};
  std::vector<std::string> argv = s.launcher_argv(s.options.nproc, true, "bench");
  argv.insert(argv.end(),
              {s.self, "bench", "allreduce", "--backend", backend, "--min-bytes", std::to_string(bytes),
               "--max-bytes", std::to_string(bytes), "--op", "avg", "--json"});
  // Across machines a few all-reduces tell the link's speed: 37 of 16 MiB took 48 s at 100 Mbit/s.
  if (s.several_machines())
    argv.insert(argv.end(), {"--warmup", "1", "--iters", "4", "--links", std::to_string(kLinkProbeBytes / 2)});
  LOCKSTEP_LOG(info, doctor) << "lockstep bench allreduce on " << backend << ", " << bytes << " bytes"
                             << (s.several_machines() ? " across the machines" : "") << "...";
  const std::string log = s.dir + "/bench.log";
  if (run_logged(argv, s.env, log) != 0 || !s.reports()) return {};
  // The launcher prefixes each line with "[rank N] "; rank 0's JSON follows.
  std::ifstream in(log);
  std::string text;
  for (std::string l; std::getline(in, l);) {
    auto p = l.find("] ");
    text += (l.rfind("[rank", 0) == 0 && p != std::string::npos ? l.substr(p + 2) : l) + "\n";
  }
  auto start = text.find('{');
  auto j = nlohmann::json::parse(start == std::string::npos ? "" : text.substr(start), nullptr, false);
  if (j.is_discarded() || !j.contains("rows") || j["rows"].empty()) return {};
  return {j["rows"][0].value("algbw_gbps", 0.0), j["rows"][0].value("network_gbps", 0.0),
          j.value("link_out_gbps", std::vector<double>{})};
}

// Which kernels multiplied, and who chose them.
std::string kernels_line(const RunSummary& run) {
  if (run.blas_core.empty()) return "";
  std::string line = "  matrix products: OpenBLAS's " + run.blas_core + " kernels";
  if (run.blas_by_launcher)
    line += ", set by lockstep run (OpenBLAS by itself picks " + run.blas_own_core + " on this CPU)";
  else if (run.blas_forced)
    line += ", set by OPENBLAS_CORETYPE";
  else if (run.blas_core == run.blas_best_core)
    line += ", the CPU's best";
  return line + "\n";
}

// The per-step times of both runs side by side, and their samples/s.
std::string breakdown_table(const RunSummary& one, const RunSummary& many) {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "  %-26s %12s %12s\n", "per step", "1 worker",
                (std::to_string(many.world) + " workers").c_str());
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
  return os.str();
}

}  // namespace

std::string format_report(const Evidence& e, const std::vector<Finding>& findings) {
  const RunSummary &one = e.one, &many = e.many;
  std::ostringstream os;
  os << "lockstep doctor: 1 worker vs " << many.world << " workers (" << many.threads << " intra-op thread"
     << (many.threads == 1 ? "" : "s") << " each, " << many.cores << " cores, backend " << many.backend
     << ", per-device batch " << many.per_device << " x " << many.accumulation << " accumulation)\n\n";
  os << breakdown_table(one, many);
  os << "  scaling efficiency: " << pct(scaling_efficiency(one, many)) << " (" << many.world
     << "-worker samples/s over " << many.world << " x 1-worker samples/s)\n";
  os << kernels_line(many);
  if (many.world > 1) {
    os << "  all-reduce inside training: " << fmt("%.1f MB", many.bytes_per_step / 1e6) << " per step in "
       << fmt("%.1f", many.buckets_per_step) << " buckets, " << ms(many.comm) << " busy, "
       << fmt("%.2f GB/s", training_gbps(many));
    if (e.bench_gbps > 0 && many.machines == 1)
      os << "; lockstep bench, same bytes and backend: " << fmt("%.2f GB/s", e.bench_gbps);
    os << "\n";
  }
  if (many.machines > 1 && many.network_bytes > 0) {
    os << "  between the " << many.machines << " machines: " << fmt("%.1f MB", many.network_bytes / 1e6)
       << " sent per step per rank in " << ms(many.network_seconds) << ", "
       << fmt("%.2f GB/s", many.network_gbps());
    if (e.bench_network_gbps > 0)
      os << "; the link as lockstep bench sees it (16 MiB all-reduces): "
         << fmt("%.2f GB/s", e.bench_network_gbps);
    os << "\n";
  }
  if (!e.link_out_gbps.empty()) {
    os << "  each machine's link out, alone (" << fmt("%.0f MiB", kLinkProbeBytes / 2 / 1048576.0)
       << " to the next machine):";
    for (std::size_t m = 0; m < e.link_out_gbps.size(); ++m)
      os << (m ? "," : "") << " machine " << m << " " << fmt("%.3f GB/s", e.link_out_gbps[m]);
    os << "\n";
  }
  if (many.pipeline > 1 && !many.bubble.empty()) {
    os << "  pipeline: " << many.pipeline << " ranks, " << many.pipeline_schedule << ", " << many.micro_batches
       << " micro-batches; per rank, bubble (schedule's):";
    for (std::size_t r = 0; r < many.bubble.size(); ++r)
      os << (r ? "," : "") << " " << r << ": " << pct(many.bubble[r]) << " ("
         << pct(r < many.bubble_analytic.size() ? many.bubble_analytic[r] : 0) << ")";
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
  for (const auto& f : findings)
    if (!f.recommendation) os << "note: " << f.problem << "\n   (" << f.action << ")\n";
  return os.str();
}

nlohmann::json findings_json(const Evidence& e, const std::vector<Finding>& findings) {
  nlohmann::json f = nlohmann::json::array();
  for (const auto& x : findings) f.push_back(x.to_json());
  return {{"one", e.one.to_json()},
          {"many", e.many.to_json()},
          {"scaling_efficiency", scaling_efficiency(e.one, e.many)},
          {"training_gbps", training_gbps(e.many)},
          {"bench_gbps", e.bench_gbps},
          {"link_out_gbps", e.link_out_gbps},
          {"findings", f}};
}

int run_doctor(const DoctorOptions& options) {
  const Session session = open_session(options);
  Evidence e;
  if (session.reports()) {
    e.one = measure(session, 1);
    e.blas_speedup = measure_blas_speedup(session, e.one);
  }
  e.many = measure(session, options.nproc);
  // Across machines every machine must ask for the same sizes, and only machine 0 knows the
  // run's buckets: there the bench measures the link with 16 MiB all-reduces instead.
  const std::size_t bytes = session.several_machines() ? kLinkProbeBytes : bench_bytes(e.many);
  const BenchFigures bench =
      measure_bench(session, session.several_machines() ? options.backend : e.many.backend, bytes);
  if (!session.reports()) {
    std::printf("lockstep doctor: machine %d took part; machine 0 prints the report\n", options.node_rank);
    return 0;
  }
  e.bench_gbps = bench.gbps;
  e.bench_network_gbps = e.many.machines > 1 ? bench.network_gbps : 0;
  e.link_out_gbps = bench.link_out_gbps;
  const auto findings = diagnose(e);
  std::printf("%s", format_report(e, findings).c_str());
  std::ofstream(session.dir + "/doctor.json") << findings_json(e, findings).dump(2) << "\n";
  std::printf("\n(runs and doctor.json in %s)\n", session.dir.c_str());
  return 0;
}

}  // namespace lockstep::doctor
