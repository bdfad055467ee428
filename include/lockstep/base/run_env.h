// What the environment tells a worker: restarts by the launcher, and the tests' fault
// injection. Torch-free.
#pragma once

#include <cstdint>

namespace lockstep {

// LOCKSTEP_RESTART_COUNT (or TORCHELASTIC_RESTART_COUNT); 0 when unset.
int restart_count_from_env();

// LOCKSTEP_FAULT_INJECT, for the tests: whether it names `kind` at `step` (a membership for the
// per-membership kinds) for `rank` (KIND:STEP[:RANK], RANK 0 when left out). The kinds and what
// each does are the knob's text (base/knobs.h, docs/environment.md). Only in the first attempt
// (LOCKSTEP_RESTART_COUNT 0), so a restarted job runs through.
bool fault_requested(const char* kind, std::int64_t step, int rank);

}  // namespace lockstep
