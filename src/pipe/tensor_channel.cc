#include "tensor_channel.h"

#include <torch/torch.h>

#include <cstring>

#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/error.h"

namespace lockstep::pipe {
namespace {

constexpr int kMaxDims = 6;
constexpr std::size_t kHeaderWords = 2 + kMaxDims;  // scalar type, dimensions, sizes

comm::DType wire_dtype(torch::ScalarType t) {
  if (const auto d = comm_dtype_of(t)) return *d;
  throw ConfigError(std::string("a pipeline stage's output is ") + c10::toString(t) +
                    ": stages can pass float32/64, float16, bfloat16, int32 and int64 tensors");
}

}  // namespace

TensorChannel::~TensorChannel() {
  try {
    wait_sends();
  } catch (...) {  // a failed send already failed the step that made it
  }
}

void TensorChannel::send(const torch::Tensor& tensor, int dst, int tag) {
  if (tensor.dim() > kMaxDims)
    throw ConfigError("a pipeline stage's output has " + std::to_string(tensor.dim()) + " dimensions; at most " +
                      std::to_string(kMaxDims) + " cross between stages");
  forget_finished_sends();
  std::int64_t h[kHeaderWords] = {};
  h[0] = static_cast<std::int64_t>(tensor.scalar_type());
  h[1] = tensor.dim();
  for (int d = 0; d < tensor.dim(); ++d) h[2 + d] = tensor.size(d);
  auto bytes = tensor.detach().to(torch::kCPU).contiguous();
  const std::string description(reinterpret_cast<const char*>(h), sizeof h);
  in_flight_.emplace_back(comm_.send_described(description, bytes.data_ptr(), std::size_t(bytes.numel()),
                                               wire_dtype(bytes.scalar_type()), dst, tag),
                          bytes);
}

// The tensor lives in a shared slot, not in this object: a recv still posted when a failed step
// unwinds past the channel can be matched later without touching freed memory.
TensorChannel::Expected TensorChannel::post(int src, int tag) {
  auto slot = std::make_shared<torch::Tensor>();
  const auto place = [slot](const std::string& description, std::size_t count, comm::DType dtype) -> void* {
    std::int64_t h[kHeaderWords];
    if (description.size() != sizeof h) throw DataError("a pipeline transfer came without its type and shape");
    std::memcpy(h, description.data(), sizeof h);
    if (h[1] < 0 || h[1] > kMaxDims)
      throw DataError("a pipeline transfer's header is damaged (" + std::to_string(h[1]) + " dimensions)");
    if (h[0] < 0 || h[0] >= static_cast<std::int64_t>(torch::ScalarType::NumOptions))
      throw DataError("a pipeline transfer's header names no element type (" + std::to_string(h[0]) + ")");
    const auto type = static_cast<torch::ScalarType>(h[0]);
    *slot = torch::empty(std::vector<std::int64_t>(h + 2, h + 2 + h[1]), torch::TensorOptions().dtype(type));
    if (std::size_t(slot->numel()) != count || wire_dtype(type) != dtype)
      throw DataError("a pipeline transfer's header does not match its bytes");
    return slot->data_ptr();
  };
  return {comm_.recv_described(place, src, tag), slot};
}

void TensorChannel::expect(int src, int tag) {
  expected_[{src, tag}].push_back(post(src, tag));
}

torch::Tensor TensorChannel::recv(int src, int tag, const torch::Device& device) {
  Expected e;
  auto it = expected_.find({src, tag});
  if (it == expected_.end()) {
    e = post(src, tag);
  } else {
    e = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) expected_.erase(it);
  }
  e.work->wait(comm_.timeout());  // from now: it may have been posted when the step began
  return device.is_cpu() ? *e.tensor : e.tensor->to(device);
}

void TensorChannel::forget_finished_sends() {
  while (!in_flight_.empty() && in_flight_.front().first->done()) {
    in_flight_.front().first->wait();  // rethrows its error
    in_flight_.pop_front();
  }
}

void TensorChannel::wait_sends() {
  while (!in_flight_.empty()) {
    in_flight_.front().first->wait();
    in_flight_.pop_front();
  }
}

}  // namespace lockstep::pipe
