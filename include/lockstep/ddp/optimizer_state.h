// The optimizers whose state ZeRO can cut into slices and put back together (SGD, Adam, AdamW:
// elementwise updates), read and written as plain tensors by name. Shared by ZeRO (zero.cc,
// zero_elastic.cc) and the train layer's sharded checkpoints; not a stable API of its own.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/ddp/torch_compat.h"
#include "lockstep/error.h"

namespace lockstep::ddp_detail {

enum class Kind { sgd, adam, adamw };

inline Kind kind_of(torch::optim::Optimizer& o) {
  if (dynamic_cast<torch::optim::AdamW*>(&o)) return Kind::adamw;
  if (dynamic_cast<torch::optim::Adam*>(&o)) return Kind::adam;
  if (dynamic_cast<torch::optim::SGD*>(&o)) return Kind::sgd;
  throw ConfigError("ZeRO: the optimizer must be SGD, Adam or AdamW (elementwise updates, state lockstep "
                    "knows how to consolidate)");
}

// One parameter's (or one slice's) state: its step count and its state tensors by name.
struct ParamState {
  std::int64_t step = 0;
  std::map<std::string, torch::Tensor> tensors;
};

template <class S>
ParamState read_adam(const S& s) {
  ParamState out{s.step(), {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}}};
  if (s.max_exp_avg_sq().defined()) out.tensors["max_exp_avg_sq"] = s.max_exp_avg_sq();
  return out;
}

inline ParamState read_state(Kind kind, const torch::optim::OptimizerParamState& s) {
  switch (kind) {
    case Kind::adamw: return read_adam(static_cast<const torch::optim::AdamWParamState&>(s));
    case Kind::adam: return read_adam(static_cast<const torch::optim::AdamParamState&>(s));
    case Kind::sgd: {
      const auto& m = static_cast<const torch::optim::SGDParamState&>(s).momentum_buffer();
      return m.defined() ? ParamState{0, {{"momentum_buffer", m}}} : ParamState{};
    }
  }
  return {};
}

template <class S>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam(const ParamState& p) {
  auto s = std::make_unique<S>();
  s->step(p.step);
  s->exp_avg(p.tensors.at("exp_avg"));
  s->exp_avg_sq(p.tensors.at("exp_avg_sq"));
  if (auto it = p.tensors.find("max_exp_avg_sq"); it != p.tensors.end()) s->max_exp_avg_sq(it->second);
  return s;
}

inline std::unique_ptr<torch::optim::OptimizerParamState> make_state(Kind kind, const ParamState& p) {
  switch (kind) {
    case Kind::adamw: return make_adam<torch::optim::AdamWParamState>(p);
    case Kind::adam: return make_adam<torch::optim::AdamParamState>(p);
    case Kind::sgd: {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(p.tensors.at("momentum_buffer"));
      return s;
    }
  }
  return nullptr;
}

// State tensors per element an optimizer will keep, for the memory record before its first step.
inline int states_per_element(Kind kind, torch::optim::Optimizer& o) {
  if (kind == Kind::sgd) return static_cast<torch::optim::SGDOptions&>(o.param_groups()[0].options()).momentum() > 0;
  return 2;
}

// The state tensors the optimizer keeps per parameter once it has stepped, by name.
inline std::vector<std::string> state_names(Kind kind, torch::optim::Optimizer& o) {
  auto& options = o.param_groups()[0].options();
  switch (kind) {
    case Kind::adamw:
      return static_cast<torch::optim::AdamWOptions&>(options).amsgrad()
                 ? std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
                 : std::vector<std::string>{"exp_avg", "exp_avg_sq"};
    case Kind::adam:
      return static_cast<torch::optim::AdamOptions&>(options).amsgrad()
                 ? std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
                 : std::vector<std::string>{"exp_avg", "exp_avg_sq"};
    case Kind::sgd:
      return states_per_element(kind, o) ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  }
  return {};
}

inline torch_compat::StateKey key_of(const torch::Tensor& t) {
  return torch_compat::state_key(t);
}

}  // namespace lockstep::ddp_detail
