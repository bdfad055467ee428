#include "env.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace lockstep::train {

int restart_count_from_env() {
  for (const char* name : {"LOCKSTEP_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}) {
    const char* v = std::getenv(name);
    if (v && *v) return std::atoi(v);
  }
  return 0;
}

bool fault_requested(const char* kind, std::int64_t step, int rank) {
  const char* spec = std::getenv("LOCKSTEP_FAULT_INJECT");
  if (!spec || restart_count_from_env() != 0) return false;
  std::string s = spec, prefix = std::string(kind) + ":";
  if (s.rfind(prefix, 0) != 0) return false;
  long long want_step = -1;
  int want_rank = 0;
  if (std::sscanf(s.c_str() + prefix.size(), "%lld:%d", &want_step, &want_rank) < 1) return false;
  return want_step == step && want_rank == rank;
}

}  // namespace lockstep::train
