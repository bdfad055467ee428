#include "lockstep/train_core/memory_usage.h"

#include <cstdio>
#include <cstring>

namespace lockstep::train {
namespace {

std::int64_t status_kib(const char* field, const char* file = "/proc/self/status") {
  FILE* f = std::fopen(file, "r");
  if (!f) return 0;
  char line[256];
  long long kib = 0;
  const std::size_t n = std::strlen(field);
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
      std::sscanf(line + n + 1, "%lld", &kib);
      break;
    }
  std::fclose(f);
  return kib * 1024;
}

}  // namespace

std::int64_t peak_rss_bytes() {
  return status_kib("VmHWM");
}

std::int64_t pss_bytes() {
  return status_kib("Pss", "/proc/self/smaps_rollup");
}

std::int64_t machine_memory_bytes() {
  return status_kib("MemTotal", "/proc/meminfo");
}

}  // namespace lockstep::train
