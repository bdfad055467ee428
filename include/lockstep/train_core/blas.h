// Which BLAS kernels this process multiplies with, and whether the CPU could run faster ones.
//
// OpenBLAS picks its kernels when it loads, so by the time lockstep's code runs only whoever
// started the process could have chosen better ones: lockstep run does (launch/worker_env.h,
// choose_blas_kernels); here the Trainer and lockstep doctor report what happened, and advise
// when a program started otherwise (mpirun, srun) runs slow kernels.
#pragma once

#include <string>

namespace lockstep::train {

struct BlasInfo {
  std::string config;  // openblas_get_config(), e.g. "OpenBLAS 0.3.21 DYNAMIC_ARCH ... Prescott ..."; "" if
                       // not OpenBLAS
  std::string core;    // openblas_get_corename(), e.g. "Prescott"; "" if not OpenBLAS
  std::string
      best_core;  // the fastest OpenBLAS kernel set this CPU runs: SkylakeX, Haswell, Sandybridge or ""
  // What OpenBLAS picks by itself: `core`, unless lockstep run chose for it (LOCKSTEP_OPENBLAS_OWN_CORE).
  std::string own_core;
  // One line naming the problem and the fix when `core` is below `best_core` and
  // OPENBLAS_CORETYPE is unset; empty otherwise.
  std::string advice;
  bool forced = false;              // OPENBLAS_CORETYPE was set: the kernels are someone's choice
  bool chosen_by_launcher = false;  // ... by lockstep run, because OpenBLAS's own pick was below the best
};

// Looks at the OpenBLAS loaded in this process, if any, and at /proc/cpuinfo.
BlasInfo blas_info();

// The advice line for kernels `core` on a CPU whose best are `best_core` ("" when there is none).
std::string blas_advice(const std::string& core, const std::string& best_core, bool coretype_set);

}  // namespace lockstep::train
