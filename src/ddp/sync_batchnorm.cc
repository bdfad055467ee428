#include "lockstep/ddp/sync_batchnorm.h"

#include <torch/torch.h>

#include "lockstep/error.h"

namespace lockstep {
namespace {

// Every dimension but the channels (1): what the statistics sum over.
std::vector<int64_t> reduced_dims(const torch::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// Channels along dimension 1, broadcastable against x.
torch::Tensor per_channel(const torch::Tensor& v, const torch::Tensor& x) {
  std::vector<int64_t> shape(std::size_t(x.dim()), 1);
  shape[1] = v.numel();
  return v.view(shape);
}

// Sums a float64 CPU-or-device vector over the ranks, in place.
void sum_over_ranks(comm::Communicator& comm, torch::Tensor& v) {
  auto host = v.to(torch::kCPU).contiguous();
  comm.allreduce(host.data_ptr(), std::size_t(host.numel()), comm::DType::f64, comm::ReduceOp::sum)->wait();
  v = host.to(v.device());
}

// The global-batch normalisation as an autograd function (see the header for the algebra).
struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias, comm::Communicator* comm,
                               torch::Tensor running_mean, torch::Tensor running_var, double factor, double eps) {
    const auto dims = reduced_dims(x);
    const int64_t channels = x.size(1);
    auto stats = torch::cat({x.sum(dims, false, torch::kDouble), (x * x).sum(dims, false, torch::kDouble),
                             torch::full({1}, double(x.numel() / channels), x.options().dtype(torch::kDouble))});
    sum_over_ranks(*comm, stats);
    const double n = stats[2 * channels].item<double>();
    if (n < 2) throw ConfigError("SyncBatchNorm: " + std::to_string(int64_t(n)) +
                                 " value(s) per channel over all ranks; training needs at least 2");
    const auto mean = stats.narrow(0, 0, channels) / n;
    const auto var = (stats.narrow(0, channels, channels) / n - mean * mean).clamp_min(0);
    const auto invstd = (var + eps).rsqrt();
    if (running_mean.defined()) {
      running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype()), factor);
      running_var.mul_(1 - factor).add_((var * (n / (n - 1))).to(running_var.dtype()), factor);
    }
    const auto mean_x = mean.to(x.dtype()), invstd_x = invstd.to(x.dtype());
    auto y = (x - per_channel(mean_x, x)) * per_channel(invstd_x, x);
    if (weight.defined()) y = y * per_channel(weight, x) + per_channel(bias, x);
    ctx->save_for_backward({x, weight, mean_x, invstd_x});
    ctx->saved_data["n"] = n;
    ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &mean = saved[2], &invstd = saved[3];
    auto* comm = reinterpret_cast<comm::Communicator*>(ctx->saved_data["comm"].toInt());
    const double n = ctx->saved_data["n"].toDouble();
    const auto& dy = grads[0];
    const auto dims = reduced_dims(x);
    const int64_t channels = x.size(1);
    const auto x_hat = (x - per_channel(mean, x)) * per_channel(invstd, x);
    auto sums = torch::cat({dy.sum(dims, false, torch::kDouble), (dy * x_hat).sum(dims, false, torch::kDouble)});
    const auto local_dy = sums.narrow(0, 0, channels).to(x.dtype());
    const auto local_dy_xhat = sums.narrow(0, channels, channels).to(x.dtype());
    sum_over_ranks(*comm, sums);
    const auto mean_dy = (sums.narrow(0, 0, channels) / n).to(x.dtype());
    const auto mean_dy_xhat = (sums.narrow(0, channels, channels) / n).to(x.dtype());
    auto scale = weight.defined() ? invstd * weight : invstd;
    auto dx = (dy - per_channel(mean_dy, x) - x_hat * per_channel(mean_dy_xhat, x)) * per_channel(scale, x);
    torch::Tensor dweight, dbias;
    if (weight.defined()) dweight = local_dy_xhat, dbias = local_dy;
    return {dx, dweight, dbias, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// A plain BatchNorm's kind, or nullptr.
const char* plain_batchnorm(const torch::nn::Module& m) {
  if (dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m)) return "torch::nn::BatchNorm1d";
  if (dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m)) return "torch::nn::BatchNorm2d";
  if (dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m)) return "torch::nn::BatchNorm3d";
  return nullptr;
}

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_) : options(options_) {
  reset();
}

// The same parameters and buffers, in the same order, as torch::nn::BatchNorm.
void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  weight = register_parameter("weight", options.affine() ? torch::ones({c}) : torch::Tensor(), options.affine());
  bias = register_parameter("bias", options.affine() ? torch::zeros({c}) : torch::Tensor(), options.affine());
  const bool track = options.track_running_stats();
  running_mean = register_buffer("running_mean", track ? torch::zeros({c}) : torch::Tensor());
  running_var = register_buffer("running_var", track ? torch::ones({c}) : torch::Tensor());
  num_batches_tracked =
      register_buffer("num_batches_tracked", track ? torch::tensor(0, torch::dtype(torch::kLong)) : torch::Tensor());
}

double SyncBatchNormImpl::average_factor() {
  if (!is_training() || !options.track_running_stats()) return options.momentum().value_or(0.0);
  num_batches_tracked += 1;
  if (options.momentum()) return *options.momentum();
  return 1.0 / num_batches_tracked.item<double>();  // a cumulative average
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  if (input.dim() < 2 || input.size(1) != options.num_features())
    throw ConfigError("SyncBatchNorm: expected input (N, " + std::to_string(options.num_features()) +
                      ", ...), got " + c10::str(input.sizes()));
  const double factor = average_factor();
  const bool batch_stats = is_training() || !options.track_running_stats();
  if (!batch_stats || !comm_ || comm_->size() == 1)
    return torch::batch_norm(input, weight, bias, running_mean, running_var, batch_stats, factor, options.eps(),
                             /*cudnn_enabled=*/true);
  torch::Tensor mean_buf, var_buf;
  if (options.track_running_stats()) mean_buf = running_mean, var_buf = running_var;
  return SyncBatchNormFunction::apply(input, weight, bias, comm_, mean_buf, var_buf, factor, options.eps());
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "lockstep::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats() << ")";
}

int sync_batchnorm(torch::nn::Module& root, comm::Communicator& comm) {
  int attached = 0;
  for (const auto& item : root.named_modules("model")) {
    if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(item.value().get())) {
      sync->sync_with(&comm);
      ++attached;
    } else if (const char* kind = plain_batchnorm(*item.value())) {
      throw ConfigError("sync_batchnorm: '" + item.key() + "' is a " + kind +
                        ", whose statistics would stay per rank: declare it as lockstep::SyncBatchNorm "
                        "(same options, parameters and checkpoints)");
    }
  }
  return attached;
}

}  // namespace lockstep
