#include "stage_parameters.h"

#include <torch/torch.h>

#include <sstream>

namespace lockstep::pipe {

std::shared_ptr<torch::nn::Module> module_of(const std::vector<std::pair<std::string, torch::Tensor>>& named) {
  auto root = std::make_shared<torch::nn::Module>();
  for (const auto& [name, tensor] : named) {
    std::vector<std::string> parts;
    std::stringstream in(name);
    for (std::string part; std::getline(in, part, '.');) parts.push_back(part);
    torch::nn::Module* at = root.get();
    for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
      auto children = at->named_children();
      if (auto* child = children.find(parts[i])) {
        at = child->get();
      } else {
        at = at->register_module(parts[i], std::make_shared<torch::nn::Module>()).get();
      }
    }
    at->register_parameter(parts.back(), tensor, tensor.requires_grad());
  }
  return root;
}

}  // namespace lockstep::pipe
