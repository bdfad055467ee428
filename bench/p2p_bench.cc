// Point-to-point round trips between two ranks on one machine, each way of moving a message in
// one run, rounds interleaved: what a pipeline's activation costs to cross between stages.
//
//   lockstep run --nproc-per-node 2 build/bench/p2p_bench [--rounds 9] [--iterations 20] [--size BYTES]
//
// Four ways, on two communicators of the same job (shared-memory lanes on, and off: loopback TCP):
//   tcp, header + payload  what the pipeline's transfers were before: a message with the type and
//                          shape, then the bytes as a second message, whose recv can be posted
//                          only once the first arrived (so the bytes are mostly kept, then copied)
//   tcp, described         one described message, placed straight into its buffer
//   shm, header + payload  as the first, through the lane
//   shm, described         what the pipeline does now
// and, for scale, the lanes alone: the same rings written and read by the ranks' own threads, with
// no mailbox (no sender thread, no reader thread, no matching): what its thread hand-offs cost.
// Every recv is posted before its message is sent. Rank 0 prints a markdown table: the median round trip per size and way over the rounds (each
// round the mean of `iterations` round trips after 3 untimed ones), and the speed-up of the last
// way over the first.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/rendezvous.h"
#include "p2p/shm_lane.h"

using namespace lockstep;
using namespace lockstep::comm;

namespace {

struct Way {
  const char* name;
  Communicator* comm;
  bool described;
};

// A recv of one message of floats from `src` into `buffer`, posted before the message is sent
// (as the pipeline posts a step's recvs when the step begins); finish() waits for it.
struct Receipt {
  const Way& way;
  std::vector<float>& buffer;
  int src;
  std::int64_t header[8] = {};
  WorkPtr first;
  Receipt(const Way& w, std::vector<float>& b, int from) : way(w), buffer(b), src(from) {
    first = way.described
                ? way.comm->recv_described([this](const std::string&, std::size_t, DType) -> void* { return buffer.data(); }, src, 1)
                : way.comm->recv(header, 8, DType::i64, src, 1);
  }
  void finish() {
    first->wait();
    if (!way.described)  // the bytes' recv can only be posted once the header told their size
      way.comm->recv(buffer.data(), static_cast<std::size_t>(header[2]), DType::f32, src, 1)->wait();
  }
};

void send(const Way& way, const std::vector<float>& buffer, std::size_t n, int dst) {
  std::int64_t header[8] = {6, 1, static_cast<std::int64_t>(n)};
  if (way.described) {
    way.comm->send_described(std::string(reinterpret_cast<const char*>(header), sizeof header), buffer.data(), n,
                             DType::f32, dst, 1)->wait();
    return;
  }
  auto h = way.comm->send(header, 8, DType::i64, dst, 1);
  way.comm->send(buffer.data(), n, DType::f32, dst, 1)->wait();
  h->wait();
}

// Seconds per round trip of `n` floats: rank 0 sends, rank 1 sends back. Each rank posts its
// next recv before it sends what the peer answers.
double round_trip(const Way& way, std::size_t n, int iterations) {
  std::vector<float> out(n, 1.0f), in(n);
  const int rank = way.comm->rank(), peer = 1 - rank;
  auto receipt = std::make_unique<Receipt>(way, in, peer);
  const auto once = [&] {
    if (rank == 0) send(way, out, n, peer);
    receipt->finish();
    receipt = std::make_unique<Receipt>(way, in, peer);
    if (rank == 1) send(way, out, n, peer);
  };
  for (int i = 0; i < 3; ++i) once();
  way.comm->barrier()->wait();
  const auto begin = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) once();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() / iterations;
  if (rank == 0) send(way, out, n, peer);  // one more exchange for the recvs left posted
  receipt->finish();
  if (rank == 1) send(way, out, n, peer);
  return seconds;
}

// The lanes alone: each rank makes the lane it writes and reads the peer's.
struct RawLanes {
  std::unique_ptr<ShmLane> out, in;
};

RawLanes open_raw_lanes(Communicator& comm) {
  std::string error;
  RawLanes lanes;
  lanes.out = ShmLane::create(2 << 20, error);  // as the mailbox makes them
  if (!lanes.out) throw std::runtime_error(error);
  const int peer = 1 - comm.rank();
  std::string name;
  auto got = comm.recv_described([&](const std::string& d, std::size_t, DType) -> void* { name = d; return nullptr; }, peer, 2);
  comm.send_described(lanes.out->name(), nullptr, 0, DType::f32, peer, 2)->wait();
  got->wait();
  lanes.in = ShmLane::open(name, error);
  if (!lanes.in) throw std::runtime_error(error);
  comm.barrier()->wait();  // both mapped both
  lanes.out->unlink();
  return lanes;
}

double raw_round_trip(RawLanes& lanes, int rank, std::size_t n, int iterations) {
  std::vector<float> out(n, 1.0f), in(n);
  const auto never = [] { return false; };
  const auto once = [&] {
    if (rank == 0) lanes.out->write({{out.data(), n * sizeof(float)}}, never);
    lanes.in->read(in.data(), n * sizeof(float), never);
    if (rank == 1) lanes.out->write({{out.data(), n * sizeof(float)}}, never);
  };
  for (int i = 0; i < 3; ++i) once();
  const auto begin = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) once();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() / iterations;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int flag(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = flag(argc, argv, "--rounds", 9), iterations = flag(argc, argv, "--iterations", 20);
  CommOptions lanes;
  lanes.backend = "shm";
  lanes.name = "p2p-shm";
  Job job = join_from_env(lanes);
  if (job.comm->size() != 2) {
    std::fprintf(stderr, "p2p_bench runs on 2 ranks (lockstep run --nproc-per-node 2)\n");
    return 2;
  }
  CommOptions tcp = lanes;
  tcp.name = "p2p-tcp";
  tcp.p2p_shared_memory = false;
  auto tcp_comm = Communicator::create(job.rendezvous->store(), job.comm->rank(), 2, tcp);
  const std::vector<Way> ways = {{"tcp, header + payload", tcp_comm.get(), false},
                                 {"tcp, described", tcp_comm.get(), true},
                                 {"shm, header + payload", job.comm.get(), false},
                                 {"shm, described", job.comm.get(), true}};
  std::vector<std::size_t> sizes = {1, 256, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20};  // bytes
  if (const int only = flag(argc, argv, "--size", 0); only > 0) sizes = {static_cast<std::size_t>(only)};
  RawLanes raw = open_raw_lanes(*job.comm);
  std::vector<std::vector<std::vector<double>>> seconds(sizes.size(), std::vector<std::vector<double>>(ways.size() + 1));
  for (int round = 0; round < rounds; ++round)
    for (std::size_t s = 0; s < sizes.size(); ++s) {
      const std::size_t n = std::max<std::size_t>(sizes[s] / 4, 1);
      for (std::size_t w = 0; w < ways.size(); ++w) seconds[s][w].push_back(round_trip(ways[w], n, iterations));
      job.comm->barrier()->wait();
      seconds[s][ways.size()].push_back(raw_round_trip(raw, job.comm->rank(), n, iterations));
      job.comm->barrier()->wait();
    }
  if (job.comm->rank() != 0) return 0;
  std::printf("| size |");
  for (const auto& w : ways) std::printf(" %s (us) |", w.name);
  std::printf(" first / shm described | lanes alone (us) |\n|---:|");
  for (std::size_t w = 0; w <= ways.size() + 1; ++w) std::printf("---:|");
  std::printf("\n");
  for (std::size_t s = 0; s < sizes.size(); ++s) {
    const std::size_t b = sizes[s];
    const std::string size = b >= (1 << 20) ? std::to_string(b >> 20) + " MiB"
                             : b >= 1024    ? std::to_string(b >> 10) + " KiB"
                                            : std::to_string(std::max<std::size_t>(b, 4)) + " B";
    std::printf("| %s |", size.c_str());
    for (std::size_t w = 0; w < ways.size(); ++w) std::printf(" %.0f |", median(seconds[s][w]) * 1e6);
    std::printf(" %.2fx | %.0f |\n", median(seconds[s][0]) / median(seconds[s][ways.size() - 1]),
                median(seconds[s][ways.size()]) * 1e6);
  }
  return 0;
}
