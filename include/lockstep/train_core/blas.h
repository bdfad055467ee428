// Which BLAS kernels this process multiplies with, and whether the CPU could run faster ones.
//
// OpenBLAS picks its kernels from the CPU model when it loads. A model newer than the OpenBLAS
// build gets the generic Prescott (SSE3) kernels: Debian 12's OpenBLAS 0.3.21 does that on
// Intel's Emerald Rapids, where its AVX-512 (SkylakeX) kernels multiply about 3x faster.
// OPENBLAS_CORETYPE, read when OpenBLAS loads, overrides the choice; nothing can change it
// afterwards, so this can only advise (the Trainer's first line, lockstep doctor).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace lockstep::train {

struct BlasInfo {
  std::string config;  // openblas_get_config(), e.g. "OpenBLAS 0.3.21 DYNAMIC_ARCH ... Prescott ..."; "" if
                       // not OpenBLAS
  std::string core;    // openblas_get_corename(), e.g. "Prescott"; "" if not OpenBLAS
  std::string
      best_core;  // the fastest OpenBLAS kernel set this CPU runs: SkylakeX, Haswell, Sandybridge or ""
  // One line naming the problem and the fix when `core` is below `best_core` and
  // OPENBLAS_CORETYPE is unset; empty otherwise.
  std::string advice;
  bool forced = false;             // OPENBLAS_CORETYPE was set: the kernels are someone's choice
  nlohmann::json to_json() const;  // {"blas": config, "blas_core", "blas_best_core", "blas_forced"}
};

// Looks at the OpenBLAS loaded in this process, if any, and at /proc/cpuinfo.
BlasInfo blas_info();

// The pure parts, for tests.
std::string best_openblas_core(const std::string& cpu_flags);  // from a /proc/cpuinfo "flags" line
int openblas_core_level(const std::string& core);  // 0 generic SSE, 1 AVX, 2 AVX2, 3 AVX-512; -1 unknown
std::string blas_advice(const std::string& core, const std::string& best_core, bool coretype_set);

}  // namespace lockstep::train
