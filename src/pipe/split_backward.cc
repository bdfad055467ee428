#include "split_backward.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
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

// For every node reachable from `root`: whether a node `target` accepts is reachable from it.
template <class Target>
std::unordered_map<Node*, bool> reaching(Node* root, const Target& target) {
  std::unordered_map<Node*, bool> reaches;
  std::vector<std::pair<Node*, std::size_t>> stack{{root, 0}};
  reaches[root] = target(root);
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->num_outputs()) {
      Node* child = node->next_edge(next++).function.get();
      if (!child) continue;
      const auto seen = reaches.find(child);
      if (seen == reaches.end()) {
        reaches[child] = target(child);
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
                                        const torch::Tensor& input, const std::vector<torch::Tensor>& eager,
                                        std::vector<torch::Tensor>* eager_grads) {
  const auto grads = grad.defined() ? variable_list{grad} : variable_list{};
  const auto root = output.grad_fn();
  if (!root) return {};
  std::unordered_set<const Node*> eager_nodes;
  for (const auto& p : eager) eager_nodes.insert(torch::autograd::impl::gradient_edge(p).function.get());
  const Node* input_node = input.defined() && input.requires_grad()
                               ? torch::autograd::impl::gradient_edge(input).function.get()
                               : nullptr;
  const auto reaches = reaching(root.get(), [&](const Node* n) { return n == input_node; });
  if (!reaches.at(root.get())) {  // nothing to split from: the weight half is the whole backward
    if (!eager.empty() && eager_grads)  // the eager ones early (the weight half accumulates them again)
      *eager_grads = torch::autograd::grad({output}, eager, grads, /*retain_graph=*/true, false, /*allow_unused=*/true);
    output_ = output;
    grad_ = grad;
    return {};
  }
  const auto to_eager = reaching(root.get(), [&](const Node* n) { return eager_nodes.count(n) > 0; });
  const auto to_other_leaf = reaching(root.get(), [&](const Node* n) {
    return dynamic_cast<const torch::autograd::AccumulateGrad*>(n) && n != input_node && eager_nodes.count(n) == 0;
  });
  captured_ = std::make_shared<Captured>();
  for (const auto& [node, on_path] : reaches) {
    if (!on_path || node == input_node) continue;
    std::vector<std::size_t> cut;  // edges into the input's path, and to eager parameters
    bool feeds_parameters = false;
    for (std::size_t i = 0; i < node->num_outputs(); ++i) {
      Node* child = node->next_edge(i).function.get();
      if (!child) continue;
      if (!reaches.at(child) && to_eager.at(child) && to_other_leaf.at(child))
        throw std::logic_error("pipeline: a tied parameter's part of the graph also leads to another parameter");
      if (reaches.at(child) || to_eager.at(child))
        cut.push_back(i);
      else
        feeds_parameters = true;
    }
    if (cut.empty() || (!feeds_parameters && !std::any_of(cut.begin(), cut.end(), [&](std::size_t i) {
          return !reaches.at(node->next_edge(i).function.get());
        })))
      continue;  // no parameter edge: nothing to split here
    if (feeds_parameters) node->add_pre_hook(std::make_unique<CaptureGrads>(captured_, split_nodes_.size()));
    split_nodes_.push_back(torch_compat::owning(node));
    cut_.push_back(std::move(cut));
  }
  captured_->grads.resize(split_nodes_.size());
  variable_list wanted{input};
  wanted.insert(wanted.end(), eager.begin(), eager.end());
  const auto got = torch::autograd::grad({output}, wanted, grads, /*retain_graph=*/true,
                                         /*create_graph=*/false, /*allow_unused=*/true);
  captured_->armed = false;
  for (std::size_t n = 0; n < split_nodes_.size(); ++n)
    for (std::size_t i : cut_[n]) split_nodes_[n]->next_edges()[i] = Edge();
  if (eager_grads) eager_grads->assign(got.begin() + 1, got.end());
  return got[0];
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
  cut_.clear();
  captured_.reset();
}

}  // namespace lockstep::pipe
