// What the environment tells the Trainer: restarts by the launcher, and the tests' fault
// injection. Torch-free.
#pragma once

#include <cstdint>

namespace lockstep::train {

// LOCKSTEP_RESTART_COUNT (or TORCHELASTIC_RESTART_COUNT); 0 when unset.
int restart_count_from_env();

// LOCKSTEP_FAULT_INJECT, for the tests: "kill-during-save:STEP" makes rank 0 die with a
// half-written checkpoint-STEP on disk; "kill-after-step:STEP:RANK" makes RANK die right after
// optimiser step STEP; "kill-before-update:STEP:RANK" and "kill-in-update:STEP:RANK" make RANK
// die in an elastic ZeRO step STEP, holding its gradients before the update may start, or once
// its slices are updated and before the all-gather. All act in the first attempt only
// (LOCKSTEP_RESTART_COUNT 0), so a restarted job runs through.
bool fault_requested(const char* kind, std::int64_t step, int rank);

}  // namespace lockstep::train
