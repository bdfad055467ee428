// The environment of a rank started by hand, without a launcher: torchrun's variables and the
// test store's address and token, what spawn_ranks gives each child (testing.h).
#pragma once

#include <map>
#include <string>

#include "testing.h"

namespace lockstep::testing {

// Rank `rank` of `world` on `store`, over `base` (whose RANK, WORLD_SIZE, ... it replaces).
inline std::map<std::string, std::string> rank_environment(int rank, int world, const LocalStore& store,
                                                           std::map<std::string, std::string> base = {}) {
  base["RANK"] = base["LOCAL_RANK"] = std::to_string(rank);
  base["WORLD_SIZE"] = base["LOCAL_WORLD_SIZE"] = std::to_string(world);
  base["LOCKSTEP_STORE_ADDR"] = "127.0.0.1:" + std::to_string(store.port());
  base["LOCKSTEP_TOKEN"] = store.token();
  return base;
}

}  // namespace lockstep::testing
