// The shared-memory objects lockstep creates in /dev/shm are named "lockstep-<creator's pid>-...".
// Each is unlinked as soon as every process that needs it has mapped it, so none outlives a job;
// a process that dies between creating one and unlinking it leaves it behind, and whoever
// supervises that process (lockstep run) removes it by the creator's pid.
#pragma once

#include <string>
#include <vector>

namespace lockstep::comm {

// Whether /dev/shm's entry `file` (as readdir gives it, no leading slash) was created by `pid`.
bool shm_segment_created_by(const std::string& file, int pid);

// Removes the objects in /dev/shm that any of `pids` created; returns how many it removed.
int remove_shm_segments_of(const std::vector<int>& pids);

}  // namespace lockstep::comm
