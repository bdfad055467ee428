// What differs between the two libtorch generations lockstep builds against, Debian's 1.13 and
// the pip wheel's 2.x, in one place: the rest of the code names these and nothing else. Each
// difference is told apart by the type libtorch declares, not by a version number, so a release
// that changes one of them breaks the build here, where it is easy to see.
//   - Optimizer::state() is keyed by a parameter's TensorImpl address written as text (1.x) or by
//     the address itself (2.x): StateKey, state_key().
//   - autograd nodes are owned by std::shared_ptr with deleteNode (1.x) or by c10::intrusive_ptr
//     (2.x): NodePtr, make_node<N>(), owning(node).
//   - c10::Allocator::allocate() is const (1.x) or not, and copy_data() is to be given (2.x):
//     an allocator derives from torch_compat::Allocator and defines allocate_bytes().
//   - Autocast's switches are per-device functions from 2.3 on (the device-named ones are
//     deprecated there, an error under -Werror) and CPU- or GPU-named ones before:
//     autocast_enabled(device type) and friends. Overloads cannot tell these apart, so here the
//     version decides.
//   - c10::Event gives out its handle (a cudaEvent_t on CUDA) in 2.x and not in 1.13:
//     event_handle(), null where it cannot.
//   - Kernels only later releases have, by version: at::scaled_dot_product_attention (2.0:
//     kFusedAttention, fused_causal_attention()) and at::_fused_adamw_ (2.4: kFusedAdamW,
//     fused_adamw()). Callers test the constant and keep their own path for the older ones.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Event.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep::torch_compat {

using StateKey = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

template <class Key>
Key state_key_as(const torch::Tensor& t) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;  // as libtorch 1.x writes it (c10::guts::to_string)
    text << t.unsafeGetTensorImpl();
    return text.str();
  } else {
    return t.unsafeGetTensorImpl();
  }
}

// The key of parameter `t`'s entry in an optimizer's state().
inline StateKey state_key(const torch::Tensor& t) {
  return state_key_as<StateKey>(t);
}

using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::Tensor&>()));

template <class T>
struct is_shared_ptr : std::false_type {};
template <class T>
struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};

template <class Node>
void delete_node(Node* node) {
  deleteNode(node);  // found by argument-dependent lookup in 1.x, never instantiated in 2.x
}

// A new autograd node of type N, owned the way this libtorch owns nodes.
template <class N, class... Args>
auto make_node(Args&&... args) {
  if constexpr (is_shared_ptr<NodePtr>::value) {
    return std::shared_ptr<N>(new N(std::forward<Args>(args)...), delete_node<torch::autograd::Node>);
  } else {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  }
}

// An owning pointer to a node of a live graph, from the node itself.
template <class Node>
NodePtr owning(Node* node) {
  if constexpr (is_shared_ptr<NodePtr>::value)
    return node->shared_from_this();
  else
    return node->getptr();
}

template <bool kConstAllocate, class Base = c10::Allocator>
class AllocatorOf;

template <class Base>
class AllocatorOf<true, Base> : public Base {
 public:
  c10::DataPtr allocate(std::size_t n) const override { return allocate_bytes(n); }

 protected:
  virtual c10::DataPtr allocate_bytes(std::size_t n) const = 0;
};

template <class Base>
class AllocatorOf<false, Base> : public Base {
 public:
  c10::DataPtr allocate(std::size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    this->default_copy_data(dest, src, count);
  }

 protected:
  virtual c10::DataPtr allocate_bytes(std::size_t n) const = 0;
};

using Allocator = AllocatorOf<std::is_same_v<decltype(&c10::Allocator::allocate),
                                             c10::DataPtr (c10::Allocator::*)(std::size_t) const>>;

// Autocast's switches for one device type, CPU or CUDA.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
inline bool autocast_enabled(at::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
inline void set_autocast_enabled(at::DeviceType d, bool on) { at::autocast::set_autocast_enabled(d, on); }
inline at::ScalarType autocast_dtype(at::DeviceType d) { return at::autocast::get_autocast_dtype(d); }
inline void set_autocast_dtype(at::DeviceType d, at::ScalarType t) { at::autocast::set_autocast_dtype(d, t); }
#else
inline bool autocast_enabled(at::DeviceType d) {
  return d == at::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
inline void set_autocast_enabled(at::DeviceType d, bool on) {
  if (d == at::kCUDA) {
    at::autocast::set_enabled(on);
  } else {
    at::autocast::set_cpu_enabled(on);
  }
}
inline at::ScalarType autocast_dtype(at::DeviceType d) {
  return d == at::kCUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
inline void set_autocast_dtype(at::DeviceType d, at::ScalarType t) {
  if (d == at::kCUDA) {
    at::autocast::set_autocast_gpu_dtype(t);
  } else {
    at::autocast::set_autocast_cpu_dtype(t);
  }
}
#endif
// Whether CPU autocast runs float16 (libtorch 2.3 and later; 1.13's knows bfloat16 only).
inline constexpr bool kCpuFloat16Autocast =
    TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3);
inline bool cpu_autocast_enabled() { return autocast_enabled(at::kCPU); }
inline void set_cpu_autocast_enabled(bool on) { set_autocast_enabled(at::kCPU, on); }
inline at::ScalarType cpu_autocast_dtype() { return autocast_dtype(at::kCPU); }
inline void set_cpu_autocast_dtype(at::ScalarType t) { set_autocast_dtype(at::kCPU, t); }

template <typename E, typename = void>
struct has_event_id : std::false_type {};
template <typename E>
struct has_event_id<E, std::void_t<decltype(std::declval<const E&>().eventId())>> : std::true_type {};

// The device's own handle of a recorded event, or null where this libtorch does not give it out
// (the caller then synchronises the device instead).
template <typename E = c10::Event>
void* event_handle(const E& event) {
  if constexpr (has_event_id<E>::value)
    return event.eventId();
  else
    return nullptr;
}

inline constexpr bool kFusedAttention = TORCH_VERSION_MAJOR >= 2;

// Causal attention without dropout in one kernel; only where kFusedAttention.
inline torch::Tensor fused_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#else
  (void)k, (void)v;
  TORCH_CHECK(false, "fused attention needs libtorch 2.0 or later");
  return q;
#endif
}

inline constexpr bool kFusedAdamW = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);

// AdamW's update of every tensor in one kernel (no amsgrad, not maximizing); only where kFusedAdamW.
// `steps` holds each parameter's step count (read, not incremented).
inline void fused_adamw(std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                        std::vector<torch::Tensor>& exp_avgs, std::vector<torch::Tensor>& exp_avg_sqs,
                        const std::vector<torch::Tensor>& steps, double lr, double beta1, double beta2,
                        double weight_decay, double eps) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2,
                    weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
#else
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)steps;
  (void)lr, (void)beta1, (void)beta2, (void)weight_decay, (void)eps;
  TORCH_CHECK(false, "the fused AdamW kernel needs libtorch 2.4 or later");
#endif
}

}  // namespace lockstep::torch_compat
