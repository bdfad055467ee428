// `lockstep bench allreduce`: the nccl-tests sweep. For each size: warm-up, a correctness
// check against values every rank can compute alone, then timed iterations between barriers.
// Time is the slowest rank's mean; algbw = bytes / time; busbw = algbw * 2(n-1)/n, the
// bandwidth each rank's link needed, comparable across world sizes and with nccl-tests.
#include "lockstep/doctor/bench_allreduce.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "lockstep/base/knobs.h"
#include "lockstep/comm/backends.h"
#include "lockstep/comm/reference.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/error.h"

namespace lockstep::doctor {

using namespace lockstep::comm;

namespace {

void fill(void* buf, DType t, std::size_t n, int rank) {
  for (std::size_t i = 0; i < n; ++i) store_element(t, buf, i, reference::input(rank, i));
}

std::size_t count_wrong(const void* out, DType t, ReduceOp op, std::size_t n, int world) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double want = reference::reduced(op, t, world, i);
    if (std::abs(load_element(t, out, i) - want) > reference::tolerance(t, want)) ++wrong;
  }
  return wrong;
}

std::string human_bytes(std::size_t b) {
  char buf[32];
  if (b >= (1u << 20))
    std::snprintf(buf, sizeof buf, "%zuM", b >> 20);
  else if (b >= (1u << 10))
    std::snprintf(buf, sizeof buf, "%zuK", b >> 10);
  else
    std::snprintf(buf, sizeof buf, "%zu", b);
  return buf;
}

// Each machine's link out, alone: machine m's first rank sends `bytes` to machine m+1's first
// rank while every other rank waits, so one slow link stands out (an all-reduce only shows the
// slowest, on every rank alike). GB/s by machine (the launcher's node rank); empty on one machine
// or outside the launcher.
std::vector<double> probe_links(Communicator& comm, std::size_t bytes) {
  const auto group = knobs::get(knobs::kGroupRank), local = knobs::get(knobs::kLocalRank);
  const std::int32_t mine[2] = {group ? std::atoi(group->c_str()) : -1, local ? std::atoi(local->c_str()) : -1};
  std::vector<std::int32_t> all(2 * static_cast<std::size_t>(comm.size()));
  comm.allgather(mine, all.data(), 2, DType::i32)->wait();
  int machines = 0;
  for (int r = 0; r < comm.size(); ++r) {
    if (all[2 * r] < 0 || all[2 * r + 1] < 0) return {};
    machines = std::max(machines, all[2 * r] + 1);
  }
  std::vector<int> first(static_cast<std::size_t>(machines), -1);
  for (int r = 0; r < comm.size(); ++r)
    if (all[2 * r + 1] == 0) first[static_cast<std::size_t>(all[2 * r])] = r;
  if (machines < 2 || std::count(first.begin(), first.end(), -1) > 0) return {};
  const std::size_t count = std::max<std::size_t>(bytes / sizeof(float), 1);
  std::vector<float> buffer(count);
  std::vector<double> gbps(static_cast<std::size_t>(machines), 0.0);
  for (int m = 0; m < machines; ++m) {
    const int from = first[static_cast<std::size_t>(m)], to = first[static_cast<std::size_t>((m + 1) % machines)];
    // One element first, so the connection exists before the clock starts.
    for (const std::size_t n : {std::size_t{1}, count}) {
      comm.barrier()->wait();
      const auto start = std::chrono::steady_clock::now();
      if (comm.rank() == from) comm.send(buffer.data(), n, DType::f32, to)->wait();
      if (comm.rank() == to) {
        comm.recv(buffer.data(), n, DType::f32, from)->wait();
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        gbps[static_cast<std::size_t>(m)] = static_cast<double>(n * sizeof(float)) / seconds / 1e9;
      }
    }
  }
  comm.allreduce(gbps.data(), gbps.size(), DType::f64, ReduceOp::max)->wait();
  return gbps;
}

}  // namespace

void BenchOptions::validate() const {
  if (!is_backend_name(backend))
    throw ConfigError("--backend '" + backend + "' is unknown: use " + backend_choices(", "));
  const std::size_t element = dtype_size(parse_dtype(dtype));
  parse_reduce_op(op);
  if (min_bytes < element)
    throw ConfigError("--min-bytes " + std::to_string(min_bytes) + " is below one " + dtype + " element (" +
                      std::to_string(element) + " bytes): the sweep starts at one element at least");
  if (max_bytes < min_bytes)
    throw ConfigError("--max-bytes " + std::to_string(max_bytes) + " is below --min-bytes " +
                      std::to_string(min_bytes));
  if (max_bytes > (std::size_t{1} << 36))
    throw ConfigError("--max-bytes " + std::to_string(max_bytes) +
                      " is above 64 GiB: each rank allocates it twice");
  if (warmup < 0 || iters < 0)
    throw ConfigError("--warmup and --iters must be at least 0 (--iters 0: chosen per size)");
}

namespace {

// One size of the sweep, as every rank agrees on it.
struct SizeResult {
  std::size_t bytes = 0, count = 0;
  int iters = 0;
  double seconds = 0;       // per all-reduce, the slowest rank's
  std::uint64_t wrong = 0;  // elements off the reference, over all ranks
  double network_gbps = 0;  // what the network transport carried meanwhile (0 on shm)
  double algbw() const { return static_cast<double>(bytes) / seconds / 1e9; }
  double busbw(int world) const { return algbw() * (world > 1 ? 2.0 * (world - 1) / world : 1.0); }
};

// Collective: one all-reduce checked against the reference, then `iters` timed (after the warm-up).
SizeResult measure_size(Communicator& comm, const BenchOptions& options, DType dtype, ReduceOp op,
                        std::vector<char>& send, std::vector<char>& recv, std::size_t bytes) {
  SizeResult r;
  r.bytes = bytes;
  r.count = bytes / dtype_size(dtype);
  fill(send.data(), dtype, r.count, comm.rank());
  comm.allreduce(send.data(), recv.data(), r.count, dtype, op)->wait();
  r.wrong = count_wrong(recv.data(), dtype, op, r.count, comm.size());
  comm.allreduce(&r.wrong, 1, DType::i64, ReduceOp::sum)->wait();

  r.iters = options.iters > 0 ? options.iters
                              : static_cast<int>(std::clamp<std::size_t>((512u << 20) / bytes, 5, 2000));
  auto timed_allreduce = [&] {
    if (options.in_place)
      comm.allreduce(recv.data(), r.count, dtype, op)->wait();
    else
      comm.allreduce(send.data(), recv.data(), r.count, dtype, op)->wait();
  };
  for (int i = 0; i < options.warmup; ++i) timed_allreduce();
  comm.barrier()->wait();
  const NetworkStats before = comm.network_stats();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < r.iters; ++i) timed_allreduce();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / r.iters;
  const NetworkStats after = comm.network_stats();
  if (after.seconds > before.seconds)
    r.network_gbps = static_cast<double>(after.bytes_sent - before.bytes_sent) / (after.seconds - before.seconds) / 1e9;
  comm.allreduce(&r.seconds, 1, DType::f64, ReduceOp::max)->wait();
  return r;
}

void print_header(const Communicator& comm, const BenchOptions& options) {
  std::printf("# lockstep bench allreduce: backend %s, %d ranks, %s %s\n", comm.backend_name().c_str(), comm.size(),
              options.dtype.c_str(), options.op.c_str());
  std::printf("%12s %12s %6s %6s %12s %10s %10s %8s\n", "size(B)", "count", "type", "redop", "time(us)",
              "algbw(GB/s)", "busbw(GB/s)", "#wrong");
}

void print_row(const SizeResult& r, const BenchOptions& options, int world) {
  std::printf("%12zu %12zu %6s %6s %12.2f %10.3f %10.3f %8llu\n", r.bytes, r.count, options.dtype.c_str(),
              options.op.c_str(), r.seconds * 1e6, r.algbw(), r.busbw(world), static_cast<unsigned long long>(r.wrong));
  std::fflush(stdout);
}

nlohmann::json json_row(const SizeResult& r, const BenchOptions& options, int world) {
  return {{"bytes", r.bytes},         {"count", r.count},          {"dtype", options.dtype},
          {"op", options.op},         {"time_us", r.seconds * 1e6}, {"algbw_gbps", r.algbw()},
          {"busbw_gbps", r.busbw(world)}, {"wrong", r.wrong},      {"iters", r.iters},
          {"network_gbps", r.network_gbps}};
}

}  // namespace

int bench_allreduce_worker(const BenchOptions& options) {
  options.validate();
  const DType dtype = parse_dtype(options.dtype);
  const ReduceOp op = parse_reduce_op(options.op);
  CommOptions comm_options;
  comm_options.backend = options.backend;
  if (options.shm_slot_bytes != 0) comm_options.shm_slot_bytes = options.shm_slot_bytes;
  Job job = join_from_env(comm_options);
  Communicator& comm = *job.comm;
  const bool reporter = comm.rank() == 0;

  std::vector<char> send(options.max_bytes), recv(options.max_bytes);
  nlohmann::json rows = nlohmann::json::array();
  std::uint64_t wrong_anywhere = 0;
  if (reporter && !options.json) print_header(comm, options);
  for (std::size_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= 2) {
    const SizeResult r = measure_size(comm, options, dtype, op, send, recv, bytes);
    if (reporter && options.json) rows.push_back(json_row(r, options, comm.size()));
    if (reporter && !options.json) print_row(r, options, comm.size());
    if (reporter && r.wrong != 0)
      std::fprintf(stderr, "lockstep bench: %llu wrong elements at %s\n", static_cast<unsigned long long>(r.wrong),
                   human_bytes(bytes).c_str());
    wrong_anywhere += r.wrong;
  }
  const std::vector<double> links = options.link_bytes > 0 ? probe_links(comm, options.link_bytes)
                                                           : std::vector<double>{};
  if (reporter && !options.json)
    for (std::size_t m = 0; m < links.size(); ++m)
      std::printf("# link out of machine %zu (to machine %zu), alone: %.3f GB/s\n", m, (m + 1) % links.size(),
                  links[m]);
  if (reporter && options.json) {
    nlohmann::json doc = {
        {"benchmark", "allreduce"}, {"backend", comm.backend_name()}, {"ranks", comm.size()}, {"rows", rows}};
    if (!links.empty()) doc["link_out_gbps"] = links;
    std::printf("%s\n", doc.dump(2).c_str());
  }
  return wrong_anywhere == 0 ? 0 : 1;
}

// Each rank contributes (rank + 1) * (i % 1000 + 1); the sum over ranks is a triangle number
// times (i % 1000 + 1), exact in f32.
int demo_worker(const std::string& backend, std::size_t count) {
  CommOptions options;
  options.backend = backend;
  const auto start = std::chrono::steady_clock::now();
  Job job = join_from_env(options);
  Communicator& comm = *job.comm;
  const double setup_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::vector<float> data(count);
  for (std::size_t i = 0; i < count; ++i)
    data[i] = static_cast<float>((comm.rank() + 1) * static_cast<int>(i % 1000 + 1));
  const auto begin = std::chrono::steady_clock::now();
  comm.allreduce(data.data(), count, DType::f32, ReduceOp::sum)->wait();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
  const int world = comm.size();
  const auto triangle = static_cast<float>(world * (world + 1) / 2);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i)
    if (data[i] != triangle * static_cast<float>(i % 1000 + 1)) ++wrong;
  std::printf("rank %d of %d, %s: joined in %.1f ms; allreduce of %zu floats in %.2f ms: %s\n", comm.rank(),
              world, comm.backend_name().c_str(), setup_ms, count, ms,
              wrong == 0 ? "correct" : (std::to_string(wrong) + " WRONG elements").c_str());
  std::fflush(stdout);
  comm.barrier()->wait();
  return wrong == 0 ? 0 : 1;
}

}  // namespace lockstep::doctor
