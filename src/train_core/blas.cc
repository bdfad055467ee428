#include "lockstep/train_core/blas.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "lockstep/base/knobs.h"

namespace lockstep::train {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("flags", 0) == 0) return line.substr(line.find(':') + 1);
  }
  return "";
}

}  // namespace

std::string best_openblas_core(const std::string& flags_line) {
  std::set<std::string> flags;
  std::istringstream in(flags_line);
  for (std::string f; in >> f;) flags.insert(f);
  auto has = [&](const char* f) { return flags.count(f) > 0; };
  if (has("avx512f") && has("avx512bw") && has("avx512vl") && has("avx512dq")) return "SkylakeX";
  if (has("avx2") && has("fma")) return "Haswell";
  if (has("avx")) return "Sandybridge";
  return "";
}

int openblas_core_level(const std::string& core) {
  const std::string c = lower(core);
  // OpenBLAS's x86-64 DYNAMIC_ARCH kernel sets, by the widest vector instructions they use.
  static const std::set<std::string> generic = {
      "katmai",     "coppermine", "northwood", "prescott", "banias",       "atom",      "core2", "penryn",
      "dunnington", "nehalem",    "athlon",    "opteron",  "opteron_sse3", "barcelona", "nano",  "bobcat"};
  static const std::set<std::string> avx = {"sandybridge", "bulldozer", "piledriver", "steamroller",
                                            "excavator"};
  static const std::set<std::string> avx2 = {"haswell", "zen"};
  static const std::set<std::string> avx512 = {"skylakex", "cooperlake", "sapphirerapids"};
  if (generic.count(c)) return 0;
  if (avx.count(c)) return 1;
  if (avx2.count(c)) return 2;
  if (avx512.count(c)) return 3;
  return -1;
}

std::string blas_advice(const std::string& core, const std::string& best_core, bool coretype_set) {
  int have = openblas_core_level(core), could = openblas_core_level(best_core);
  if (coretype_set || have < 0 || could <= have) return "";
  return "OpenBLAS is using its " + core + " kernels, but this CPU runs its " + best_core +
         " kernels (OpenBLAS did not recognise the CPU model): start with OPENBLAS_CORETYPE=" + best_core +
         " for faster matrix products (about 3x measured on an Emerald Rapids machine; lockstep doctor "
         "measures it for your program)";
}

nlohmann::json BlasInfo::to_json() const {
  return {{"blas", config}, {"blas_core", core}, {"blas_best_core", best_core}, {"blas_forced", forced}};
}

BlasInfo blas_info() {
  BlasInfo info;
  using NameFn = char* (*)();
  auto corename = reinterpret_cast<NameFn>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  auto config = reinterpret_cast<NameFn>(::dlsym(RTLD_DEFAULT, "openblas_get_config"));
  if (corename) info.core = corename();
  if (config) info.config = config();
  info.best_core = best_openblas_core(cpu_flags());
  info.forced = knobs::is_set(knobs::kOpenblasCoretype);
  info.advice = blas_advice(info.core, info.best_core, info.forced);
  return info;
}

}  // namespace lockstep::train
