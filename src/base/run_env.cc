#include "lockstep/base/run_env.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "lockstep/base/knobs.h"

namespace lockstep {

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
  for (std::size_t begin = 0; begin <= spec->size();) {  // KIND:STEP[:RANK], comma-separated
    const std::size_t end = std::min(spec->find(',', begin), spec->size());
    const std::string one = spec->substr(begin, end - begin);
    begin = end + 1;
    if (one.rfind(prefix, 0) != 0) continue;
    long long want_step = -1;
    int want_rank = 0;
    if (std::sscanf(one.c_str() + prefix.size(), "%lld:%d", &want_step, &want_rank) < 1) continue;
    if (want_step == step && want_rank == rank) return true;
  }
  return false;
}

}  // namespace lockstep
