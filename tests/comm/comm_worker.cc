// A rank for the multi-process tests. Started as one of N processes with the env contract.
//   comm_worker conformance BACKEND [SLOT_BYTES]   run the conformance table; exit 0 if all match
//   comm_worker loop BACKEND                        all-reduce until a peer fails; report how
// Exit codes: 0 ok, 1 wrong results or other error, 3 PeerError, 4 TimeoutError, 5 MismatchError.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "conformance.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/error.h"

using namespace lockstep;
using namespace lockstep::comm;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: comm_worker conformance|loop BACKEND [SLOT_BYTES]\n");
    return 2;
  }
  std::string mode = argv[1];
  CommOptions options;
  options.backend = argv[2];
  if (argc > 3) options.shm_slot_bytes = std::strtoull(argv[3], nullptr, 10);
  try {
    Job job = join_from_env(options);
    Communicator& comm = *job.comm;
    if (mode == "conformance") {
      auto failures = testing::run_conformance(comm, {0, 1, 7, 1000, 5000});
      for (const auto& f : failures) std::printf("WRONG %s\n", f.c_str());
      std::printf("rank %d: %zu failures on %s\n", comm.rank(), failures.size(), comm.backend_name().c_str());
      return failures.empty() ? 0 : 1;
    }
    if (mode == "loop") {
      std::vector<float> data(1 << 18, 1.0f);
      comm.allreduce(data.data(), data.size(), DType::f32, ReduceOp::sum)->wait();
      job.rendezvous->store()->set("ready/" + std::to_string(comm.rank()), "1");
      for (;;) comm.allreduce(data.data(), data.size(), DType::f32, ReduceOp::avg)->wait();
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
