// One optimiser step: per_step samples in micro-batches of the per-device batch, all but the
// last under no_sync (only the last all-reduces), each micro-batch's loss weighted so the
// gradient is the mean over the whole step; then clipping by global norm after the all-reduce,
// the learning rate of this step, and the optimiser.
#include <torch/torch.h>

#include "lockstep/base/log.h"
#include "lockstep/ddp/autocast.h"
#include "lockstep/error.h"
#include "lockstep/train/tensor_memory.h"
#include "cuda_graph_step.h"
#include "trainer_impl.h"

namespace lockstep::train {

struct TrainingStep::MicroBatch {
  int index = 0, count = 1;
  double mean_over = 1;      // the step's samples per rank: a sample's loss weighs 1 / mean_over
  bool placeholder = false;  // a stand-in batch of a rank with no samples this step: weight 0
  bool last() const { return index == count - 1; }
};

// Forward and backward of one micro-batch; adds its times to `t` and its loss to `window`.
void TrainingStep::forward_backward(data::DataLoader<Batch>& loader, const MicroBatch& micro, StepTimes& t,
                                    LogWindow& window) {
  Trainer::Impl& trainer = run_;
  const auto begin = Clock::now();
  auto batch = next_batch(loader);
  const auto loaded = Clock::now();
  if (!batch) throw Error("internal: the loader ran out before the epoch's samples did");
  const double samples = static_cast<double>(batch->target.size(0));
  const double targets = static_cast<double>(batch->target.numel());  // samples, or tokens
  // A tensor group's ranks share one batch: its tokens count once, by tensor rank 0.
  const bool counts_tokens = !trainer.tensor_comm || trainer.tensor_comm->rank() == 0;
  if (batch->target.dim() >= 2 && counts_tokens) window.add_tokens(targets);
  if (reducer_) {
    reducer_->set_sync(micro.last());
    reducer_->before_forward();  // broadcasts buffers: a wait for the slowest rank, not compute
  }
  if (zero_) zero_->before_forward();  // stage 3: the root unit's parameters
  const auto synced = Clock::now();
  torch::Tensor loss;
  {
    Autocast autocast(trainer.autocast_dtype(), trainer.device.type());
    torch::Tensor out = trainer.model.forward(batch->input.to(trainer.device));
    if (reducer_) reducer_->after_forward(&out);
    loss = trainer.loss_fn(loss_input(out), batch->target.to(trainer.device));
  }
  if (!micro.placeholder) window.add_loss(loss.item<double>(), targets);
  // The mean over this micro-batch, weighted to make the mean over the whole step once the
  // ranks' gradients are averaged (micro-batches hold equal targets per sample, so weighting by
  // samples is weighting by targets).
  auto scaled = loss * (micro.placeholder ? 0.0 : samples / micro.mean_over);
  if (trainer.args.fp16) scaled = scaled * loss_scale_.scale();  // into float16's range (loss_scale.h)
  const auto forwarded = Clock::now();
  scaled.backward();
  const auto backwarded = Clock::now();
  t.data += seconds_between(begin, loaded);
  t.forward += seconds_between(synced, forwarded);
  t.buffer_sync += seconds_between(loaded, synced);
  t.backward += seconds_between(forwarded, backwarded);
  if (TraceWriter* trace = trainer.trace()) {
    trace->span("data wait", 1, begin, loaded);
    trace->span("forward", 1, synced, forwarded, {{"micro_batch", micro.index}});
    trace->span(micro.last() ? "backward + all-reduce" : "backward (no_sync)", 1, forwarded, backwarded);
  }
}

// The all-reduce of this step, as the reducer saw it: exposed time is taken out of backward.
void TrainingStep::account_communication(StepTimes& t, double& bytes, int& buckets) {
  if (!reducer_) return;
  const DdpStats& st = reducer_->stats();
  t.exposed_comm = st.exposed_comm_seconds + t.buffer_sync;
  t.comm = st.comm_seconds;
  t.backward -= st.exposed_comm_seconds;
  bytes = static_cast<double>(st.bytes_allreduced);
  buckets = st.bucket_count;
  if (TraceWriter* trace = run_.trace())
    for (const auto& b : st.buckets)
      trace->span("all-reduce", 2, b.started, b.finished,
                  {{"bucket", b.index}, {"parameters", b.parameters}, {"bytes", b.bytes}});
}

// --fp16: the gradients divided by the loss scale again, and whether every one is finite. Every
// rank decides alike: it holds the same all-reduced gradients (under ZeRO, its slices of them,
// and the ranks agree on the answer; under tensor parallelism its shards, and under a pipeline
// its stages' parameters: then every rank agrees, so that a gradient that overflowed on one rank
// skips the step on all).
bool TrainingStep::unscale_gradients() {
  const double inverse = 1.0 / loss_scale_.scale();
  if (zero_) return zero_->unscale_gradients(inverse);
  std::vector<torch::Tensor> finite;
  for (auto& p : run_.model.module->parameters()) {
    if (!p.grad().defined()) continue;
    p.mutable_grad().mul_(inverse);
    finite.push_back(torch::isfinite(p.grad()).all());
  }
  std::int32_t all_finite = finite.empty() || torch::stack(finite).all().item<bool>();
  if (run_.tensor_comm || pipeline_)
    run_.comm->allreduce(&all_finite, 1, comm::DType::i32, comm::ReduceOp::min)->wait();
  return all_finite != 0;
}

// --fp16: an overflowed step changes no parameter; the scale falls and the next step tries again.
bool TrainingStep::skip_overflowed_step() {
  const double scale = loss_scale_.scale();
  if (loss_scale_.update(!unscale_gradients())) return false;
  if (zero_)
    zero_->skip_step();
  else
    zero_gradients();
  // Under local SGD each machine decides for itself: the first rank of each says so.
  bool speaks = run_.rank() == 0;
  std::string where;
  if (outer_) {
    speaks = machine_comm_->rank() == 0;
    where = " on machine " + std::to_string(run_.comm->machine_of()[std::size_t(run_.rank())]);
  }
  if (speaks)
    LOCKSTEP_LOG(warn, train) << "step " << run_.state.global_step + 1
                              << ": a gradient overflowed float16 at loss scale "
                              << scale << where << ": the update is skipped and the scale is now "
                              << loss_scale_.scale();
  return true;
}

// Clipping by global norm, this step's learning rate, the optimiser.
void TrainingStep::apply_update(LogWindow& window) {
  const double max_norm = run_.args.max_grad_norm;
  if (max_norm > 0)
    window.set_grad_norm(zero_               ? zero_->clip_grad_norm(max_norm)
                         : run_.tensor_comm ? tensor_parallel_clip(max_norm)
                                            : torch::nn::utils::clip_grad_norm_(run_.model.module->parameters(), max_norm));
  const double lr = run_.learning_rate_at(run_.state.global_step);
  for (auto& group : stepper().param_groups()) group.options().set_lr(lr);
  if (zero_) {  // its slices, then every rank gets the new parameters
    zero_->step();
    zero_->zero_grad();
  } else {
    optimizer_->step();
    share_updates();  // ZeRO-1 by tensors: each data rank's share to the others
    zero_gradients();
  }
}

void TrainingStep::optimizer_step(StepTimes& t, LogWindow& window) {
  const auto begin = Clock::now();
  if (!run_.args.fp16 || !skip_overflowed_step()) apply_update(window);
  const auto end = Clock::now();
  t.optimizer = seconds_between(begin, end);
  if (TraceWriter* trace = run_.trace()) trace->span("optimizer", 1, begin, end);
  // Local SGD: the machines meet (waiting for each other) every K steps, skipped or not, so that
  // all count alike (a machine's own gradients may overflow where another's do not).
  if (outer_ && outer_->step()) {
    t.exposed_comm += outer_->last_seconds();
    t.comm += outer_->last_seconds();
    if (TraceWriter* trace = run_.trace()) trace->span("machines meet", 1, end, Clock::now());
  }
}

StepTimes TrainingStep::run(data::DataLoader<Batch>& loader, const StepPlan& plan, LogWindow& window) {
  if (pipeline_) return pipeline_step(loader, plan, window);
  const std::int64_t tensors_at_start = tensor_bytes();
  reset_peak_tensor_bytes();
  double bytes = 0;
  int buckets = 0;
  std::optional<StepTimes> replayed = cuda_graph_ ? cuda_graph_->step(loader, window) : std::nullopt;
  const StepTimes t = replayed ? *replayed : eager_step(loader, plan, window, bytes, buckets);
  window.add_step(t, plan.all_ranks_samples, bytes, buckets);
  window.add_step_tensor_bytes(static_cast<double>(peak_tensor_bytes() - tensors_at_start));
  return t;
}

StepTimes TrainingStep::eager_step(data::DataLoader<Batch>& loader, const StepPlan& plan, LogWindow& window,
                                  double& bytes, int& buckets) {
  const auto begin = Clock::now();
  const auto batch_size = static_cast<std::size_t>(run_.args.per_device_train_batch_size);
  MicroBatch micro;
  micro.count = static_cast<int>((plan.samples + batch_size - 1) / batch_size);
  // The step's samples per data rank: a tensor group's ranks share one batch.
  const int tensor_ranks = run_.tensor_comm ? run_.tensor_comm->size() : 1;
  micro.mean_over = plan.all_ranks_samples / (run_.world() / tensor_ranks);
  micro.placeholder = plan.placeholder;
  StepTimes t;
  for (micro.index = 0; micro.index < micro.count; ++micro.index)
    forward_backward(loader, micro, t, window);
  account_communication(t, bytes, buckets);
  optimizer_step(t, window);
  t.total = seconds_between(begin, Clock::now());
  return t;
}

std::optional<Batch> TrainingStep::next_batch(data::DataLoader<Batch>& loader) {
  if (cuda_graph_)
    if (auto batch = cuda_graph_->take_batch()) return batch;
  return loader.next();
}

}  // namespace lockstep::train
