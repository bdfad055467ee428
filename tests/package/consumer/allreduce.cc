// Each rank adds rank + 1 to every element; the sum over ranks is W(W+1)/2 everywhere.
#include <cstdio>
#include <vector>

#include "lockstep/base/main.h"
#include "lockstep/comm/rendezvous.h"

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [] {
    auto job = lockstep::comm::join_from_env();
    auto& comm = *job.comm;
    std::vector<float> data(1000, static_cast<float>(comm.rank() + 1));
    comm.allreduce(data.data(), data.size(), lockstep::comm::DType::f32, lockstep::comm::ReduceOp::sum)->wait();
    const float want = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
    for (float v : data)
      if (v != want) return 1;
    std::printf("allreduce ok rank %d of %d on %s\n", comm.rank(), comm.size(), comm.backend_name().c_str());
    return 0;
  });
}
