// How the models' torch-free CPU kernels are built: each public function once per instruction set
// (AVX-512, AVX2 with FMA, and the baseline), the best one the CPU has chosen when the program
// loads (GCC's target_clones), with their helpers inlined into every copy.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOCKSTEP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LOCKSTEP_CLONES
#endif
#define LOCKSTEP_INLINE inline __attribute__((always_inline))
