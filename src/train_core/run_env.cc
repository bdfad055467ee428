#include "lockstep/train_core/run_env.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "lockstep/base/knobs.h"

namespace lockstep::train {

int restart_count_from_env() {
  for (const knobs::Knob* k : {&knobs::kRestartCount, &knobs::kTorchelasticRestartCount}) {
    if (!knobs::is_set(*k)) continue;
    if (auto v = knobs::get(*k)) return std::atoi(v->c_str());
  }
  return 0;
}

bool fault_requested(const char* kind, std::int64_t step, int rank) {
  auto spec = knobs::get(knobs::kFaultInject);
  if (!spec || restart_count_from_env() != 0) return false;
  const std::string prefix = std::string(kind) + ":";
  if (spec->rfind(prefix, 0) != 0) return false;
  long long want_step = -1;
  int want_rank = 0;
  if (std::sscanf(spec->c_str() + prefix.size(), "%lld:%d", &want_step, &want_rank) < 1) return false;
  return want_step == step && want_rank == rank;
}

}  // namespace lockstep::train
