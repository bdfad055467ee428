// Checking that every rank wraps the same model: torch-free, so it builds and tests with the core.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"

namespace lockstep::ddp_detail {

struct ParamSignature {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
};

std::string describe(const ParamSignature& p);  // "fc1.weight float32[64, 784]"
std::string serialize(const std::vector<ParamSignature>& params);
std::vector<ParamSignature> deserialize(const std::string& text);

// Collective: gathers every rank's list; when they differ, throws the same ConfigError on
// every rank, naming the first differing parameter and the ranks involved.
void check_same_parameters(comm::Communicator& comm, const std::vector<ParamSignature>& mine);

}  // namespace lockstep::ddp_detail
