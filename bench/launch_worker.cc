// The lockstep side of bench/compare_launch.py: join the job, pass one barrier, print the
// wall-clock time (seconds since the epoch) at which this rank got past it.
#include <chrono>
#include <cstdio>

#include "lockstep/base/main.h"
#include "lockstep/comm/rendezvous.h"

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [] {
    auto job = lockstep::comm::join_from_env();
    job.comm->barrier()->wait();
    auto now = std::chrono::system_clock::now().time_since_epoch();
    std::printf("PAST_BARRIER %.6f\n", std::chrono::duration<double>(now).count());
    return 0;
  });
}
