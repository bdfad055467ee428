#include "split_backward.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <unordered_map>
#include <utility>

namespace lockstep::pipe {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct SplitBackward::Captured {
  bool armed = true;
  std::vector<variable_list> grads;  // per split node: what it was given in the input half
};

namespace {

struct CaptureGrads : torch::autograd::FunctionPreHook {
  CaptureGrads(std::shared_ptr<SplitBackward::Captured> c, std::size_t i) : captured(std::move(c)), index(i) {}
  variable_list operator()(const variable_list& grads) override {
    if (captured->armed) captured->grads[index] = grads;
    return grads;
  }
  std::shared_ptr<SplitBackward::Captured> captured;
  std::size_t index;
};

// For every node reachable from `root`: whether `target` is reachable from it (the input's path).
std::unordered_map<Node*, bool> reaching(Node* root, const Node* target) {
  std::unordered_map<Node*, bool> reaches;
  std::vector<std::pair<Node*, std::size_t>> stack{{root, 0}};
  reaches[root] = root == target;
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->num_outputs()) {
      Node* child = node->next_edge(next++).function.get();
      if (!child) continue;
      const auto seen = reaches.find(child);
      if (seen == reaches.end()) {
        reaches[child] = child == target;
        stack.emplace_back(child, 0);
      } else if (seen->second) {
        reaches[node] = true;
      }
      continue;
    }
    const bool mine = reaches[node];
    stack.pop_back();
    if (mine && !stack.empty()) reaches[stack.back().first] = true;
  }
  return reaches;
}

}  // namespace

torch::Tensor SplitBackward::input_half(const torch::Tensor& output, const torch::Tensor& grad,
                                        const torch::Tensor& input) {
  const auto root = output.grad_fn();
  if (!input.defined() || !input.requires_grad() || !root) {
    output_ = output;  // everything waits for the weight half
    grad_ = grad;
    return {};
  }
  const Edge input_edge = torch::autograd::impl::gradient_edge(input);
  const auto reaches = reaching(root.get(), input_edge.function.get());
  if (!reaches.at(root.get())) {
    output_ = output;
    grad_ = grad;
    return {};
  }
  captured_ = std::make_shared<Captured>();
  std::vector<std::vector<std::size_t>> cut;  // per split node: its edges into the input's path
  for (const auto& [node, on_path] : reaches) {
    if (!on_path || node == input_edge.function.get()) continue;
    std::vector<std::size_t> into_path;
    bool feeds_parameters = false;
    for (std::size_t i = 0; i < node->num_outputs(); ++i) {
      Node* child = node->next_edge(i).function.get();
      if (!child) continue;
      if (reaches.at(child))
        into_path.push_back(i);
      else
        feeds_parameters = true;
    }
    if (!feeds_parameters) continue;
    node->add_pre_hook(std::make_unique<CaptureGrads>(captured_, split_nodes_.size()));
    split_nodes_.push_back(torch_compat::owning(node));
    cut.push_back(std::move(into_path));
  }
  captured_->grads.resize(split_nodes_.size());
  const auto grads = grad.defined() ? variable_list{grad} : variable_list{};
  const auto input_grad = torch::autograd::grad({output}, {input}, grads, /*retain_graph=*/true,
                                                /*create_graph=*/false, /*allow_unused=*/true);
  captured_->armed = false;
  for (std::size_t n = 0; n < split_nodes_.size(); ++n)
    for (std::size_t i : cut[n]) split_nodes_[n]->next_edges()[i] = Edge();
  return input_grad[0];
}

void SplitBackward::weight_half() {
  if (output_.defined()) {
    if (output_.requires_grad())
      torch::autograd::backward({output_}, grad_.defined() ? variable_list{grad_} : variable_list{});
    output_ = grad_ = torch::Tensor();
    return;
  }
  torch::autograd::edge_list roots;
  variable_list inputs;
  for (std::size_t n = 0; n < split_nodes_.size(); ++n)
    for (std::size_t slot = 0; slot < captured_->grads[n].size(); ++slot)
      if (captured_->grads[n][slot].defined()) {
        roots.emplace_back(split_nodes_[n], static_cast<std::uint32_t>(slot));
        inputs.push_back(captured_->grads[n][slot]);
      }
  if (!roots.empty())
    torch::autograd::Engine::get_default_engine().execute(roots, inputs, /*keep_graph=*/false,
                                                          /*create_graph=*/false, /*accumulate_grad=*/true);
  split_nodes_.clear();
  captured_.reset();
}

}  // namespace lockstep::pipe
