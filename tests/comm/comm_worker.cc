// A rank for the multi-process tests. Started as one of N processes with the env contract.
//   comm_worker conformance BACKEND [SLOT_BYTES]   run the conformance table; exit 0 if all match
//   comm_worker loop BACKEND                        all-reduce until a peer fails; report how
//                                                   (on shm, shared buffers too)
//   comm_worker env BACKEND WORLD                   check the launcher's env contract, all-reduce
//   comm_worker die BACKEND                         rank 1 kills itself (first attempt only)
//   comm_worker elastic BACKEND STEPS               an elastic member (LOCKSTEP_ELASTIC): all-reduces
//                                                   a one STEPS times (5 ms apart), admits joiners
//                                                   every 5 steps, recovers from failures
//   comm_worker p2p BACKEND                         run the point-to-point table; exit 0 if all match
//   comm_worker p2p_die BACKEND                     rank 0 waits to receive from rank 1, which is killed
//   comm_worker p2p_kill BACKEND K recv|send kill|stop  rank 0 receives (sends) 32 MiB messages from (to)
//                                                   rank 1 and kills (stops) it after K of them, mid-transfer
//   comm_worker stall BACKEND                       after one all-reduce, rank 1 waits for a
//                                                   signal while the others all-reduce again
// Exit codes: 0 ok, 1 wrong results or other error, 3 PeerError, 4 TimeoutError, 5 MismatchError.
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "conformance.h"
#include "p2p_exchange.h"
#include "lockstep/comm/elastic.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/error.h"

using namespace lockstep;
using namespace lockstep::comm;

namespace {

std::string env_or(const char* name, const char* fallback = "") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// Checks what lockstep run promises every worker, then all-reduces the ranks: prints
// "env ok rank R of W" only when everything holds, and a line naming each problem otherwise.
int check_env(const CommOptions& options, int expected_world) {
  int problems = 0;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::printf("ENV PROBLEM: %s\n", what.c_str());
      ++problems;
    }
  };
  for (const char* name :
       {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "LOCKSTEP_STORE_ADDR", "LOCKSTEP_TOKEN",
        "LOCKSTEP_RESTART_COUNT", "LOCKSTEP_RUN_ID"})
    expect(!env_or(name).empty(), std::string(name) + " is not set");
  int rank = std::atoi(env_or("RANK", "-1").c_str()), world = std::atoi(env_or("WORLD_SIZE", "0").c_str());
  int local = std::atoi(env_or("LOCAL_RANK", "-1").c_str()),
      local_world = std::atoi(env_or("LOCAL_WORLD_SIZE", "0").c_str());
  int group = std::atoi(env_or("GROUP_RANK", "-1").c_str());
  expect(world == expected_world,
         "WORLD_SIZE=" + std::to_string(world) + ", expected " + std::to_string(expected_world));
  expect(rank >= 0 && rank < world, "RANK out of range");
  expect(local >= 0 && local < local_world, "LOCAL_RANK out of range");
  expect(rank == group * local_world + local, "RANK != GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK");
  expect(env_or("ROLE_RANK") == env_or("RANK"), "ROLE_RANK != RANK");
  expect(env_or("LOCKSTEP_RUN_ID") == env_or("TORCHELASTIC_RUN_ID"), "run ids differ");
  std::string store = env_or("LOCKSTEP_STORE_ADDR");
  expect(store.substr(store.rfind(':') + 1) != env_or("MASTER_PORT"), "MASTER_PORT is the store's port");
  Job job = join_from_env(options);
  std::int64_t sum = job.comm->rank();
  job.comm->allreduce(&sum, 1, DType::i64, ReduceOp::sum)->wait();
  expect(sum == static_cast<std::int64_t>(world) * (world - 1) / 2,
         "allreduce of ranks gave " + std::to_string(sum));
  if (problems == 0)
    std::printf("env ok rank %d of %d on %s\n", job.comm->rank(), job.comm->size(),
                job.comm->backend_name().c_str());
  return problems == 0 ? 0 : 1;
}

// An elastic loop as a program without the Trainer writes one (comm::run_elastic): every step
// all-reduces a one and checks it counted every member; the state a member behind takes is the
// step counter. Pacing: 5 ms per step.
struct Counter : ElasticState {
  std::int64_t steps = 0;
  std::int64_t completed_steps() const override { return steps; }
  std::string save() const override { return std::to_string(steps); }
  void load(const std::string& bytes) override { steps = std::stoll(bytes); }
};

int elastic_member(const CommOptions& options, int steps) {
  auto group = join_elastic_from_env(options);
  std::printf("joined membership %llu as rank %d of %d\n", static_cast<unsigned long long>(group->epoch()),
              group->rank(), group->size());
  std::fflush(stdout);
  Counter counter;
  bool wrong = false;
  ElasticLoop loop;
  loop.check_every = 5;
  loop.step = [&] {
    if (counter.steps >= steps) return false;
    std::int64_t one = 1;
    group->comm().allreduce(&one, 1, DType::i64, ReduceOp::sum)->wait();
    if (one != group->size()) {
      std::printf("WRONG: %lld members counted, %d in the membership\n", static_cast<long long>(one), group->size());
      wrong = true;
      return false;
    }
    ++counter.steps;
    std::printf("step %lld of %d workers\n", static_cast<long long>(counter.steps), group->size());
    std::fflush(stdout);
    ::usleep(5000);  // pacing the load, not synchronisation
    return true;
  };
  loop.changed = [&](const MembershipChange& c) {
    if (c.reason == "join")
      std::printf("grew to membership %llu: %d workers\n", static_cast<unsigned long long>(c.epoch), group->size());
    else
      std::printf("recovered into membership %llu: %d workers, %zu left, after %.3f s agreeing and %.3f s rebuilding\n",
                  static_cast<unsigned long long>(c.epoch), group->size(), c.left.size(), c.agree_seconds,
                  c.rebuild_seconds);
    std::fflush(stdout);
  };
  run_elastic(*group, counter, loop);
  if (wrong) return 1;
  std::printf("done: rank %d of %d after %lld steps\n", group->rank(), group->size(),
              static_cast<long long>(counter.steps));
  return 0;
}

// Rank 0 and rank 1 stream 32 MiB messages without a gap (message k filled with k % 2, from two
// buffers filled once), rank 0 receiving (`rank0_sends` false) or sending; after `whole` of them
// rank 0 sends rank 1 `signal` (SIGKILL, or SIGSTOP: alive but stuck), while rank 1 is in the
// middle of the next, and goes on until an operation fails. Exit 3 when that is a PeerError (or,
// for a stopped peer, a TimeoutError) within 10 s of a kill (30 s of a stop) and every message
// received before it was whole (a part of one would leave the previous one's values); 1
// otherwise. Rank 0 kills a stopped rank 1 at the end.
int kill_mid_transfer(Communicator& comm, int whole, bool rank0_sends, int signal) {
  std::int64_t pid = ::getpid();
  std::vector<std::int64_t> pids(static_cast<std::size_t>(comm.size()));
  comm.allgather(&pid, pids.data(), 1, DType::i64)->wait();
  const std::size_t n = std::size_t{8} << 20;
  const std::vector<float> filled[2] = {std::vector<float>(n, 0.0f), std::vector<float>(n, 1.0f)};
  std::vector<float> in(n, -1.0f);
  const int peer = 1 - comm.rank();
  const bool sending = (comm.rank() == 0) == rank0_sends;
  const auto transfer = [&](int k) {
    return sending ? comm.send(filled[k % 2].data(), n, DType::f32, peer, 0) : comm.recv(in.data(), n, DType::f32, peer, 0);
  };
  const auto whole_message = [&](int k) { return sending || in == filled[k % 2]; };
  int k = 0;
  if (comm.rank() == 1)
    for (;; ++k) {
      transfer(k)->wait();  // until killed
      if (!whole_message(k)) return 1;
    }
  for (; k < whole; ++k) transfer(k)->wait();
  auto next = transfer(k);
  const auto killed = Clock::now();
  ::kill(static_cast<pid_t>(pids[1]), signal);
  struct KillAtEnd {
    pid_t pid;
    ~KillAtEnd() { ::kill(pid, SIGKILL); }
  } kill_at_end{static_cast<pid_t>(pids[1])};
  const auto report = [&](const char* kind, const std::exception& e) {
    const double after = Seconds(Clock::now() - killed).count();
    std::printf("%s %.3f s after the signal, at message %d (%d whole before it): %s\n", kind, after, k, whole, e.what());
    // A kill shows at once; a stopped peer after the timeout, which TCP counts per blocked write.
    return after < (signal == SIGKILL ? 10 : 30) ? 3 : 1;
  };
  try {
    for (;;) {
      next->wait();
      if (!whole_message(k)) {
        std::printf("message %d arrived incomplete from a rank killed while sending it\n", k);
        return 1;
      }
      next = transfer(++k);
    }
  } catch (const PeerError& e) {
    return report("PeerError", e);
  } catch (const TimeoutError& e) {
    if (signal != SIGSTOP) throw;
    return report("TimeoutError", e);
  }
}

// The kernels the OpenBLAS behind libblas.so.3 (libtorch's BLAS on Debian) runs in this process.
int print_blas_core() {
  void* blas = ::dlopen("libblas.so.3", RTLD_NOW | RTLD_LOCAL);
  auto corename = blas ? reinterpret_cast<char* (*)()>(::dlsym(blas, "openblas_get_corename")) : nullptr;
  std::printf("blas core '%s'\n", corename ? corename() : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: comm_worker conformance|loop|blas|... BACKEND [SLOT_BYTES]\n");
    return 2;
  }
  std::string mode = argv[1];
  CommOptions options;
  options.backend = argv[2];
  if (argc > 3 && mode != "elastic" && mode != "p2p_kill") options.shm_slot_bytes = std::strtoull(argv[3], nullptr, 10);
  try {
    if (mode == "blas") return print_blas_core();
    if (mode == "env") return check_env(options, argc > 3 ? std::atoi(argv[3]) : -1);
    if (mode == "elastic") return elastic_member(options, argc > 3 ? std::atoi(argv[3]) : 100);
    Job job = join_from_env(options);
    Communicator& comm = *job.comm;
    if (mode == "conformance") {
      auto failures = testing::run_conformance(comm, {0, 1, 7, 1000, 5000});
      for (const auto& f : failures) std::printf("WRONG %s\n", f.c_str());
      std::printf("rank %d: %zu failures on %s\n", comm.rank(), failures.size(), comm.backend_name().c_str());
      return failures.empty() ? 0 : 1;
    }
    if (mode == "p2p") {
      auto failures = testing::run_p2p_exchange(comm);
      for (const auto& f : failures) std::printf("WRONG %s\n", f.c_str());
      std::printf("rank %d: %zu point-to-point failures on %s\n", comm.rank(), failures.size(),
                  comm.backend_name().c_str());
      return failures.empty() ? 0 : 1;
    }
    if (mode == "p2p_kill")
      return kill_mid_transfer(comm, std::atoi(argv[3]), argc > 4 && std::string(argv[4]) == "send",
                               argc > 5 && std::string(argv[5]) == "stop" ? SIGSTOP : SIGKILL);
    if (mode == "p2p_die") {
      std::int32_t x = 0;
      WorkPtr pending;
      if (comm.rank() == 0) pending = comm.recv(&x, 1, DType::i32, 1, 0);
      comm.barrier()->wait();  // rank 0's recv is posted
      if (comm.rank() == 1) raise(SIGKILL);
      pending->wait();
      std::printf("rank 0 received %d from a rank that was killed\n", x);
      return 0;
    }
    if (mode == "die") {
      std::vector<float> data(1 << 16, 1.0f);
      const bool first_attempt = job.rendezvous->info().restart_count == 0;
      for (int step = 0; step < 20; ++step) {
        if (step == 3 && comm.rank() == 1 && first_attempt) {
          std::fprintf(stderr, "rank 1 is about to be killed\n");
          std::fflush(stderr);
          raise(SIGKILL);
        }
        comm.allreduce(data.data(), data.size(), DType::f32, ReduceOp::avg)->wait();
      }
      std::printf("rank %d finished 20 steps\n", comm.rank());
      return 0;
    }
    if (mode == "stall") {
      float v = 1;
      comm.allreduce(&v, 1, DType::f32, ReduceOp::sum)->wait();
      if (comm.rank() == 1) {
        ::pause();  // alive, but never issues the next collective: the launcher's SIGTERM ends it
        return 0;
      }
      comm.allreduce(&v, 1, DType::f32, ReduceOp::sum)->wait();
      return 0;
    }
    if (mode == "loop") {
      // Alternates staged and (on shm) shared-buffer all-reduces, so a death hits either.
      std::vector<float> data(1 << 18, 1.0f);
      auto shared = comm.allocate_shared(data.size() * sizeof(float));
      auto round = [&](ReduceOp op) {
        comm.allreduce(data.data(), data.size(), DType::f32, op)->wait();
        if (shared) comm.allreduce(shared.get(), data.size(), DType::f32, op)->wait();
      };
      round(ReduceOp::sum);
      job.rendezvous->store()->set("ready/" + std::to_string(comm.rank()), "1");
      std::printf("ready rank %d pid %d\n", comm.rank(), static_cast<int>(getpid()));
      std::fflush(stdout);
      for (;;) round(ReduceOp::avg);
    }
  } catch (const PeerError& e) {
    std::printf("PeerError: %s\n", e.what());
    return 3;
  } catch (const TimeoutError& e) {
    std::printf("TimeoutError: %s\n", e.what());
    return 4;
  } catch (const MismatchError& e) {
    std::printf("MismatchError: %s\n", e.what());
    return 5;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
  return 2;
}
