#include "tensor_channel.h"

#include <torch/torch.h>

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
  auto header = torch::zeros({std::int64_t(kHeaderWords)}, torch::kLong);
  auto* h = header.data_ptr<std::int64_t>();
  h[0] = static_cast<std::int64_t>(tensor.scalar_type());
  h[1] = tensor.dim();
  for (int d = 0; d < tensor.dim(); ++d) h[2 + d] = tensor.size(d);
  auto bytes = tensor.detach().to(torch::kCPU).contiguous();
  in_flight_.emplace_back(comm_.send(h, kHeaderWords, comm::DType::i64, dst, tag), header);
  in_flight_.emplace_back(comm_.send(bytes.data_ptr(), std::size_t(bytes.numel()), wire_dtype(bytes.scalar_type()), dst, tag),
                          bytes);
}

torch::Tensor TensorChannel::recv(int src, int tag, const torch::Device& device) {
  std::int64_t h[kHeaderWords];
  comm_.recv(h, kHeaderWords, comm::DType::i64, src, tag)->wait();
  if (h[1] < 0 || h[1] > kMaxDims) throw DataError("a pipeline transfer's header is damaged (" + std::to_string(h[1]) + " dimensions)");
  const auto type = static_cast<torch::ScalarType>(h[0]);
  auto out = torch::empty(std::vector<std::int64_t>(h + 2, h + 2 + h[1]), torch::TensorOptions().dtype(type));
  comm_.recv(out.data_ptr(), std::size_t(out.numel()), wire_dtype(type), src, tag)->wait();
  return device.is_cpu() ? out : out.to(device);
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
