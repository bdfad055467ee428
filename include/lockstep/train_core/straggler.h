// Which rank the others wait for. In data-parallel training every step ends in an all-reduce, so
// the step of every rank takes as long as the slowest rank's own work: one slow rank (a loaded
// machine, slow storage) slows all, and shows as the others' exposed communication. This names
// it from per-rank times, and says whether its data loading or its compute is what is slow.
// Torch-free.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace lockstep::train {

// One rank's mean seconds per step over a log window.
struct RankBusy {
  double data = 0;     // waiting for batches
  double compute = 0;  // forward, backward (hidden communication included) and the optimizer
  double step = 0;     // the whole step, waits included (0: not known)
};

struct Straggler {
  int rank = -1;
  std::string cause;  // "data loading" or "compute"
  double ratio = 1;   // its busy time over the median of the other ranks'
  std::string describe() const;
};

// The rank whose data + compute time per step is at least 1.5x the median of the others' and
// 5 ms more (noise on a shared host moves single ranks by less), and whose excess is at least a
// tenth of the ranks' median step (behind a slow link, a rank a few ms late costs the step a few
// per cent: the link, not the rank, is what the others wait for), if there is one. Its cause is
// the part (data or compute) that exceeds the others' medians by more.
std::optional<Straggler> find_straggler(const std::vector<RankBusy>& ranks);

}  // namespace lockstep::train
