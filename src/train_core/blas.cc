#include "lockstep/train_core/blas.h"

#include <dlfcn.h>

#include "lockstep/base/cpu_kernels.h"
#include "lockstep/base/knobs.h"

namespace lockstep::train {

std::string blas_advice(const std::string& core, const std::string& best_core, bool coretype_set) {
  if (coretype_set || !openblas_core_below(core, best_core)) return "";
  return "OpenBLAS is using its " + core + " kernels, but this CPU runs its " + best_core +
         " kernels (OpenBLAS did not recognise the CPU model): start with OPENBLAS_CORETYPE=" + best_core +
         " for faster matrix products (3.6x measured on an Emerald Rapids machine; lockstep run sets it for "
         "its workers, and lockstep doctor measures it for your program)";
}

BlasInfo blas_info() {
  BlasInfo info;
  using NameFn = char* (*)();
  auto corename = reinterpret_cast<NameFn>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  auto config = reinterpret_cast<NameFn>(::dlsym(RTLD_DEFAULT, "openblas_get_config"));
  if (corename) info.core = corename();
  if (config) info.config = config();
  info.best_core = best_openblas_core(this_cpus_flags());
  info.forced = knobs::is_set(knobs::kOpenblasCoretype);
  const auto own = knobs::get(knobs::kOpenblasOwnCore);
  info.chosen_by_launcher = info.forced && own.has_value();
  info.own_core = info.chosen_by_launcher ? *own : info.core;
  info.advice = blas_advice(info.core, info.best_core, info.forced);
  return info;
}

}  // namespace lockstep::train
