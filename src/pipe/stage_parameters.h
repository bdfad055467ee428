// Parameters by the model's dotted names as a module: a submodule per name component, the tensors
// themselves (shared, not copied) as its parameters. What the parts of lockstep that take a module
// (the reducer, the optimizer's checkpoint files) see of a pipeline stage.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::pipe {

// named_parameters() of the result is `named`, in order, under the same names.
std::shared_ptr<torch::nn::Module> module_of(const std::vector<std::pair<std::string, torch::Tensor>>& named);

}  // namespace lockstep::pipe
