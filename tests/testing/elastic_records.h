// What the elastic tests' Trainer program (tests/train/elastic_trainer_worker.cc) recorded: for
// each optimiser step that completed, the samples it trained on. A step in progress when a member
// failed is taken again in the next membership; only the newest membership's take counts. A
// worker that never saw a step complete (it failed in the step's all-reduce, or was killed) counts
// for that step if the others completed it in the same membership: the all-reduce had its share.
// A step recorded with nothing loaded for it was trained before a change; only what follows a
// step (its checkpoint, its callbacks) was completed after it.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>

namespace lockstep::testing {

// Step -> the samples every worker loaded for it, from every DIR/*.samples file.
std::map<std::int64_t, std::multiset<std::size_t>> trained_samples(const std::string& dir);

// "" when each of `epochs` epochs of `steps_per_epoch` steps trained every sample 0..samples-1
// exactly once; otherwise the first thing that is wrong.
std::string each_sample_once_per_epoch(const std::map<std::int64_t, std::multiset<std::size_t>>& steps,
                                       std::int64_t steps_per_epoch, std::int64_t epochs, std::size_t samples);

}  // namespace lockstep::testing
