#include "cuda_graph_step.h"

#include <torch/torch.h>

#include <utility>
#include <vector>

#include "lockstep/base/log.h"
#include "lockstep/error.h"
#include "trainer_impl.h"

#if LOCKSTEP_TORCH_CUDA
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "lockstep/ddp/autocast.h"
#include "lockstep/ddp/torch_compat.h"
#endif

namespace lockstep::train {

#if LOCKSTEP_TORCH_CUDA

namespace {

// One parameter group's lists as the fused AdamW kernel takes them, over the parameters that have
// optimizer state (every one that had a gradient in the warm-up steps).
struct GraphedGroup {
  const torch::optim::AdamWOptions* options = nullptr;
  std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs;
  std::vector<torch::Tensor> steps;                      // on the device: what the graph reads
  std::vector<torch::optim::AdamWParamState*> states;  // on the host: what checkpoints save
};

bool same_shapes(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type();
}

}  // namespace

struct CudaGraphStep::Impl {
  explicit Impl(Trainer::Impl& t) : trainer(t) {}
  ~Impl() {
    try {
      c10::cuda::device_synchronize();  // the last replay done before the graph and its memory go
      if (graph) trainer.step.stepper().zero_grad();  // the graph's gradient buffers go with it
    } catch (const std::exception& e) {
      LOCKSTEP_LOG(warn, train) << "--cuda-graphs: the device failed at the end of training: " << e.what();
    }
  }

  Trainer::Impl& trainer;
  int eager_steps = 0;
  bool warned_shape = false;
  bool steps_stale = false;  // an eager step ran since capture: the device's step counts lag the host's
  std::optional<Batch> returned;
  std::optional<c10::cuda::CUDAStreamGuard> on_stream;  // declared before the graph: restored after it goes
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  torch::Tensor input, target;      // static: each batch is copied in
  torch::Tensor lr;                 // static: this step's learning rate
  torch::Tensor loss, grad_norm;    // static: the graph's outputs
  std::vector<GraphedGroup> groups;

  void collect_groups();
  void record_step();
  void capture();
  void copy_in(const Batch& batch);
  void sync_step_counts();
};

// Before capture: the tensors the update reads, and step counts on the device from the host's.
void CudaGraphStep::Impl::collect_groups() {
  auto& optimizer = trainer.step.stepper();
  auto& states = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    GraphedGroup g;
    g.options = &static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (auto& p : group.params()) {
      auto found = states.find(torch_compat::state_key(p));
      if (found == states.end()) continue;  // no gradient in the warm-up: none in the graph either
      auto* state = dynamic_cast<torch::optim::AdamWParamState*>(found->second.get());
      if (!state) throw ConfigError("--cuda-graphs: the optimizer is not AdamW; use --optim adamw");
      g.params.push_back(p);
      g.exp_avgs.push_back(state->exp_avg());
      g.exp_avg_sqs.push_back(state->exp_avg_sq());
      g.steps.push_back(torch::full({}, static_cast<double>(state->step()),
                                    torch::TensorOptions().dtype(torch::kFloat).device(p.device())));
      g.states.push_back(state);
    }
    if (!g.params.empty()) groups.push_back(std::move(g));
  }
  if (groups.empty()) throw Error("--cuda-graphs: no parameter got a gradient in the warm-up steps: nothing to capture");
}

// The step as the graph holds it: forward and loss under autocast, backward, clipping by global
// norm, AdamW (the fused kernel, reading the learning rate and the step counts from the device).
void CudaGraphStep::Impl::record_step() {
  {
    Autocast autocast(trainer.autocast_dtype(), trainer.device.type());
    torch::Tensor out = trainer.model.forward(input);
    loss = trainer.loss_fn(loss_input(out), target);
  }
  loss.backward();
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> all_grads;
  for (auto& g : groups) {
    for (auto& p : g.params) {
      if (!p.grad().defined())
        throw Error("--cuda-graphs: a parameter that had a gradient in the warm-up steps has none in the captured "
                    "step: the model's graph changes from step to step; train without --cuda-graphs");
      g.grads.push_back(p.grad());
      all_grads.push_back(p.grad());
    }
  }
  const double max_norm = trainer.args.max_grad_norm;
  if (max_norm > 0) {  // libtorch's clip_grad_norm_, without reading the norm on the host
    grad_norm = torch::stack(at::_foreach_norm(all_grads, 2)).norm(2);
    at::_foreach_mul_(all_grads, torch::clamp(max_norm / (grad_norm + 1e-6), std::nullopt, 1.0));
  }
  for (auto& g : groups) {
    at::_foreach_add_(g.steps, 1);
    at::_fused_adamw_(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, /*max_exp_avg_sqs=*/{}, g.steps, lr,
                      std::get<0>(g.options->betas()), std::get<1>(g.options->betas()), g.options->weight_decay(),
                      g.options->eps(), /*amsgrad=*/false, /*maximize=*/false);
  }
}

// Records the step into the graph (nothing runs until the first replay). Autocast's cache of
// cast weights is off meanwhile: a cast kept from capture would not be redone by a replay.
void CudaGraphStep::Impl::capture() {
  collect_groups();
  graph = std::make_unique<at::cuda::CUDAGraph>();
  const bool cache = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
  graph->capture_begin();
  try {
    record_step();
  } catch (const std::exception& e) {
    try {
      graph->capture_end();
    } catch (...) {  // the capture is invalid already: the error that made it so is the one to report
    }
    at::autocast::set_autocast_cache_enabled(cache);
    throw Error(std::string("--cuda-graphs: the step could not be captured (") + e.what() +
                "): something in it waits for the host; train without --cuda-graphs");
  }
  graph->capture_end();
  at::autocast::set_autocast_cache_enabled(cache);
}

// The batch into the static inputs, asynchronously from pinned memory.
void CudaGraphStep::Impl::copy_in(const Batch& batch) {
  if (!input.defined()) {
    input = torch::empty(batch.input.sizes(), batch.input.options().device(trainer.device));
    target = torch::empty(batch.target.sizes(), batch.target.options().device(trainer.device));
    lr = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(trainer.device));
  }
  input.copy_(batch.input.pin_memory(), /*non_blocking=*/true);
  target.copy_(batch.target.pin_memory(), /*non_blocking=*/true);
}

// After eager steps: the device's step counts from the host's again.
void CudaGraphStep::Impl::sync_step_counts() {
  for (auto& g : groups)
    for (std::size_t i = 0; i < g.states.size(); ++i) g.steps[i].fill_(static_cast<double>(g.states[i]->step()));
  steps_stale = false;
}

std::string CudaGraphStep::refusal(const Trainer::Impl& trainer) {
  if (!trainer.device.is_cuda())
    return "the model trains on " + trainer.device.str() + "; CUDA graphs need --device cuda";
  if (trainer.world() > 1 || trainer.elastic)
    return std::to_string(trainer.world()) + " workers: the gradient all-reduce is not captured yet, only one "
           "worker's step; start one worker, or drop --cuda-graphs";
  return "";
}

CudaGraphStep::CudaGraphStep(Trainer::Impl& trainer) : impl_(std::make_unique<Impl>(trainer)) {
  c10::cuda::device_synchronize();  // what the default stream was given (a resume's loads) is done
  impl_->on_stream.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, trainer.device.index()));
  if (trainer.rank() == 0)
    LOCKSTEP_LOG(info, train) << "--cuda-graphs: " << kWarmupSteps
                              << " eager steps, then the step is captured into a CUDA graph and replayed";
}

std::optional<StepTimes> CudaGraphStep::step(data::DataLoader<Batch>& loader, LogWindow& window) {
  Impl& s = *impl_;
  Trainer::Impl& t = s.trainer;
  if (s.eager_steps < kWarmupSteps) {
    ++s.eager_steps;
    return std::nullopt;
  }
  const auto begin = Clock::now();
  auto batch = loader.next();
  if (!batch) throw Error("internal: the loader ran out before the epoch's samples did");
  const auto loaded = Clock::now();
  if (s.input.defined() && !(same_shapes(batch->input, s.input) && same_shapes(batch->target, s.target))) {
    if (!s.warned_shape && t.rank() == 0)
      LOCKSTEP_LOG(warn, train) << "--cuda-graphs: step " << t.state.global_step + 1 << "'s batch has another shape ("
                                << batch->input.sizes() << ") than the captured one (" << s.input.sizes()
                                << "): such steps run eagerly (an epoch's last batch, say)";
    s.warned_shape = true;
    s.returned = std::move(batch);
    s.steps_stale = s.graph != nullptr;
    t.step.stepper().zero_grad();  // the eager step's gradients are its own, not the graph's buffers
    return std::nullopt;
  }
  s.copy_in(*batch);
  const double lr = t.learning_rate_at(t.state.global_step);
  for (auto& group : t.step.stepper().param_groups()) group.options().set_lr(lr);
  s.lr.fill_(lr);
  if (!s.graph) s.capture();
  if (s.steps_stale) s.sync_step_counts();
  const auto launched = Clock::now();
  s.graph->replay();
  for (auto& g : s.groups)
    for (auto* state : g.states) state->step(state->step() + 1);
  const double targets = static_cast<double>(batch->target.numel());
  if (batch->target.dim() >= 2) window.add_tokens(targets);
  window.add_loss(s.loss.item<double>(), targets);  // waits for the replay
  if (t.args.max_grad_norm > 0) window.set_grad_norm(s.grad_norm.item<double>());
  const auto done = Clock::now();
  StepTimes times;
  times.data = seconds_between(begin, loaded);
  times.backward = seconds_between(launched, done);  // the whole replay, forward to update: one span
  times.total = seconds_between(begin, done);
  if (TraceWriter* trace = t.trace()) {
    trace->span("data wait", 1, begin, loaded);
    trace->span("graph replay", 1, launched, done);
  }
  return times;
}

#else  // a libtorch without CUDA: refused before training, so never constructed

struct CudaGraphStep::Impl {
  std::optional<Batch> returned;
};

std::string CudaGraphStep::refusal(const Trainer::Impl&) {
  return "this build's libtorch has no CUDA (build on PyTorch 2.x from pip where the CUDA toolkit is installed: "
         "LOCKSTEP_TORCH=pip)";
}

CudaGraphStep::CudaGraphStep(Trainer::Impl& trainer) : impl_(std::make_unique<Impl>()) {
  throw ConfigError("--cuda-graphs: " + refusal(trainer));
}

std::optional<StepTimes> CudaGraphStep::step(data::DataLoader<Batch>&, LogWindow&) { return std::nullopt; }

#endif

CudaGraphStep::~CudaGraphStep() = default;

std::optional<Batch> CudaGraphStep::take_batch() {
  return std::exchange(impl_->returned, std::nullopt);
}

}  // namespace lockstep::train
