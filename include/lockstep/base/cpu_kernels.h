// Which OpenBLAS kernels this CPU runs best, and which ones OpenBLAS picks by itself.
//
// OpenBLAS picks its kernels from the CPU model when it loads. A model newer than the OpenBLAS
// build gets the generic Prescott (SSE3) kernels: Debian 12's OpenBLAS 0.3.21 does that on
// Intel's Emerald Rapids, where its AVX-512 (SkylakeX) kernels multiply about 3.6x faster.
// OPENBLAS_CORETYPE, read when OpenBLAS loads, overrides the choice and nothing changes it
// afterwards: only whoever starts the process (lockstep run) can fix it. Torch-free.
#pragma once

#include <string>

namespace lockstep {

// The fastest OpenBLAS kernel set a CPU with these /proc/cpuinfo flags runs: "SkylakeX",
// "Haswell", "Sandybridge", or "" (nothing above the generic kernels).
std::string best_openblas_core(const std::string& cpu_flags);
std::string this_cpus_flags();  // /proc/cpuinfo's first "flags" line

// 0 generic SSE, 1 AVX, 2 AVX2, 3 AVX-512, by the widest vectors a kernel set uses; -1 unknown.
int openblas_core_level(const std::string& core);

// Whether `core` (what OpenBLAS picked) is below `best` (what the CPU runs). False when either is
// unknown: a name this table does not know is never overridden.
bool openblas_core_below(const std::string& core, const std::string& best);

// The kernels the OpenBLAS behind libblas.so.3 picks by itself on this machine, "" when that is not
// OpenBLAS or cannot be loaded. Asked in a short-lived child, so the caller neither loads the
// library nor starts its threads, with OPENBLAS_CORETYPE removed from the child's environment.
std::string openblas_own_core();

}  // namespace lockstep
