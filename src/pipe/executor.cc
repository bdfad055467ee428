// One step as the schedule table has it: this rank's actions in order. Recvs block (the bubble),
// sends return at once, and each stage's replicas start reducing its gradients from the hooks of
// its last micro-batch's backward; the step ends when every send is on its way and every
// reduction done.
#include <torch/torch.h>

#include "lockstep/base/clock.h"
#include "lockstep/ddp/autocast.h"
#include "lockstep/ddp/cpu_rng.h"
#include "lockstep/error.h"
#include "pipeline_impl.h"

namespace lockstep::pipe {
namespace {

using Key = std::pair<int, int>;  // stage, micro-batch

torch::Tensor take(std::map<Key, torch::Tensor>& from, const Action& a) {
  const auto it = from.find({a.stage, a.micro_batch});
  if (it == from.end()) throw std::logic_error("pipeline: " + to_string(a) + " has nothing to work on");
  torch::Tensor t = std::move(it->second);
  from.erase(it);
  return t;
}

int kind_of(Op op) {
  switch (op) {
    case Op::forward: return 0;
    case Op::backward: return 1;
    case Op::backward_input: return 2;
    default: return 3;
  }
}

// Seconds of one call, added to `total`.
template <class F>
auto timed(double& total, F&& f) {
  const auto begin = Clock::now();
  struct Add {
    double& total;
    Clock::time_point begin;
    ~Add() { total += seconds_between(begin, Clock::now()); }
  } add{total, begin};
  return f();
}

const char* what_of(Channel c) {
  switch (c) {
    case Channel::activation: return "activations";
    case Channel::gradient: return "gradient";
    case Channel::tied_gradient: return "tied parameters' gradient";
    case Channel::tied_value: return "tied parameters' new values";
  }
  return "?";
}

}  // namespace

// A transfer into `stage` on tag (c, slot, micro_batch) (slot: the receiving stage, or a tied
// parameter's index), its error (a dead sender, a deadline) naming both ends by stage and by
// worker (the job's rank), not only by their place in the pipeline group.
torch::Tensor Pipeline::Impl::receive(int from_stage, int stage, Channel c, int slot, int micro_batch) {
  const int from = rank_of(from_stage);
  auto context = [&] {
    return "pipeline stage " + std::to_string(stage) + " (worker " + std::to_string(world.rank()) +
           ") waited for the " + what_of(c) +
           (c == Channel::tied_value ? "" : " of micro-batch " + std::to_string(micro_batch)) + " from stage " +
           std::to_string(from_stage) + " (worker " + std::to_string(mesh.rank_at(from, replica)) + "): ";
  };
  try {
    return channel->recv(from, tag_of(c, slot, micro_batch), device);
  } catch (const PeerError& e) {
    throw PeerError(context() + e.what());
  } catch (const TimeoutError& e) {
    throw TimeoutError(context() + e.what());
  }
}

// Posts the recv of every activation and gradient `actions` will receive, as receive() will ask
// for them, so that each lands in its tensor as it arrives.
void Pipeline::Impl::expect_transfers(const std::vector<Action>& actions) {
  if (channel->has_expectations())
    throw Error("a pipeline step failed earlier with transfers still posted, which would take this step's tensors: "
                "the pipeline cannot run another step; restart the job (lockstep run --max-restarts resumes from "
                "the last checkpoint)");
  for (const Action& a : actions) {
    if (a.op == Op::recv_activation)
      channel->expect(rank_of(a.stage - 1), tag_of(Channel::activation, a.stage, a.micro_batch));
    else if (a.op == Op::recv_gradient)
      channel->expect(rank_of(a.stage + 1), tag_of(Channel::gradient, a.stage, a.micro_batch));
  }
}

// What one step carries from action to action on this rank.
struct Pipeline::Impl::Step {
  const std::vector<MicroBatch>& batches;
  std::vector<std::uint64_t> seeds;  // one per micro-batch, as the unpipelined model draws one per forward
  std::map<Key, torch::Tensor> received, to_send, output_grads;
  PipelineStepStats stats;
  StepRecord* record = nullptr;
  int m() const { return int(batches.size()); }
  // An action's compute time: the step's stats, and the record the analytic bubble is simulated from.
  void note(const Action& a, double seconds) {
    record->seconds[(std::size_t(a.stage) * 4 + std::size_t(kind_of(a.op))) * std::size_t(m()) +
                    std::size_t(a.micro_batch)] = seconds;
    stats.compute_seconds += seconds;
    if (a.op == Op::forward) stats.forward_seconds += seconds;
  }
};

PipelineStepStats Pipeline::Impl::run(const std::vector<MicroBatch>& batches) {
  const auto step_begin = Clock::now();
  const int m = int(batches.size());
  if (m < 1 || m > kMaxMicroBatches)
    throw ConfigError("a pipeline step needs 1 to " + std::to_string(kMaxMicroBatches) + " micro-batches (got " +
                      std::to_string(m) + ")");
  const ScheduleTable& t = table(m);
  Step step{batches, {}, {}, {}, {}, {}, nullptr};
  step.stats.micro_batches = m;
  timed(step.stats.wait_seconds, [&] { tied->take_values(); });
  for (int k = 0; k < m; ++k) step.seeds.push_back(draw_cpu_seed());
  if (recorded.size() == kRecordedSteps) recorded.erase(recorded.begin());  // nobody asked for a report
  step.record = &recorded.emplace_back();
  step.record->micro_batches = m;
  step.record->seconds.assign(std::size_t(stages()) * 4 * std::size_t(m), 0);
  expect_transfers(t.actions[std::size_t(prank)]);
  for (const Action& a : t.actions[std::size_t(prank)]) {
    switch (a.op) {
      case Op::forward: forward(a, step); break;
      case Op::backward:
      case Op::backward_input:
      case Op::backward_weight: backward(a, t, step); break;
      default: transfer(a, step); break;
    }
  }
  tied->set_running(-1);
  timed(step.stats.send_seconds, [&] { channel->wait_sends(); });
  timed(step.stats.reduce_seconds, [&] {
    for (auto& r : reducers)
      if (r) r->finish();
  });
  step.stats.step_seconds = seconds_between(step_begin, Clock::now());
  return step.stats;
}

void Pipeline::Impl::forward(const Action& a, Step& step) {
  const int s = a.stage, k = a.micro_batch;
  StageChunk& chunk = *chunks.at(s);
  const MicroBatch& batch = step.batches[std::size_t(k)];
  const torch::Tensor input = s == 0 ? batch.input.to(device) : take(step.received, a);
  const auto begin = Clock::now();
  {
    Autocast autocast(options.autocast, device.type());
    if (chunk.last()) {
      const torch::Tensor value = chunk.forward_loss(k, input, step.seeds[std::size_t(k)], batch, loss);
      const double targets = double(batch.target.numel());
      step.stats.loss_sum += value.item<double>() * targets;
      step.stats.loss_targets += targets;
    } else {
      step.to_send[{s, k}] = chunk.forward(k, input, step.seeds[std::size_t(k)]);
    }
  }
  step.note(a, seconds_between(begin, Clock::now()));
}

void Pipeline::Impl::backward(const Action& a, const ScheduleTable& t, Step& step) {
  const int s = a.stage, k = a.micro_batch;
  StageChunk& chunk = *chunks.at(s);
  // The stage's last whole backward (or weight half: an earlier weight half may come after the last
  // input half) of the step: its replicas reduce from the gradient hooks on.
  if (a.op == t.weight_op() && k == step.m() - 1 && !reducers.empty())
    if (auto& reducer = reducers[std::size_t(s / options.pipeline_parallel)]) {
      reducer->set_sync(true);
      reducer->before_forward();
    }
  tied->set_running(k);
  const auto begin = Clock::now();
  if (a.op == Op::backward_weight) {
    chunk.backward_weight(k);
  } else if (a.op == Op::backward) {
    tied->set_capturing(true);  // the last stage's hooks keep its tied gradients as backward reaches them
    const auto input_grad = chunk.backward(k, chunk.last() ? torch::Tensor() : take(step.output_grads, a));
    tied->set_capturing(false);
    if (s > 0) step.to_send[{s, k}] = input_grad;
  } else {
    // The last stage's tied gradients in the input half, for the first stage waiting on them.
    const bool eager = chunk.last() && !tied->tensors().empty() && !holds(0);
    std::vector<torch::Tensor> tied_grads;
    const auto input_grad = chunk.backward_input(k, chunk.last() ? torch::Tensor() : take(step.output_grads, a),
                                                 eager ? tied->tensors() : std::vector<torch::Tensor>{}, &tied_grads);
    if (eager)
      for (std::size_t i = 0; i < tied_grads.size(); ++i) tied->keep(k, i, tied_grads[i]);
    if (s > 0) step.to_send[{s, k}] = input_grad;
  }
  step.note(a, seconds_between(begin, Clock::now()));
  if (a.op != Op::backward_input) tied->forget(k);
}

void Pipeline::Impl::transfer(const Action& a, Step& step) {
  const int s = a.stage, k = a.micro_batch;
  PipelineStepStats& st = step.stats;
  switch (a.op) {
    case Op::recv_activation:
      step.received[{s, k}] = timed(st.wait_seconds, [&] { return receive(s - 1, s, Channel::activation, s, k); });
      break;
    case Op::recv_gradient:
      step.output_grads[{s, k}] = timed(st.wait_seconds, [&] { return receive(s + 1, s, Channel::gradient, s, k); });
      break;
    case Op::recv_tied:
      timed(st.wait_seconds, [&] { tied->receive_gradients(k); });
      break;
    case Op::send_activation:
      timed(st.send_seconds, [&] { channel->send(take(step.to_send, a), rank_of(s + 1), tag_of(Channel::activation, s + 1, k)); });
      break;
    case Op::send_gradient:
      timed(st.send_seconds, [&] { channel->send(take(step.to_send, a), rank_of(s - 1), tag_of(Channel::gradient, s - 1, k)); });
      break;
    case Op::send_tied:
      timed(st.send_seconds, [&] { tied->send_gradients(k); });
      break;
    default:
      throw std::logic_error("pipeline: " + to_string(a) + " is not a transfer");
  }
}

void Pipeline::forward_only(const std::vector<MicroBatch>& batches,
                            const std::function<void(int, const torch::Tensor&)>& consume) {
  Impl& s = *impl_;
  const int m = int(batches.size());
  if (m == 0) return;
  if (m > kMaxMicroBatches) throw ConfigError("a pipeline pass takes at most " + std::to_string(kMaxMicroBatches) + " micro-batches");
  s.tied->take_values();
  const ScheduleTable t = make_forward_schedule(s.options.pipeline_parallel, m, s.options.virtual_stages);
  std::map<Key, torch::Tensor> received, to_send;
  torch::NoGradGuard no_grad;
  s.expect_transfers(t.actions[std::size_t(s.prank)]);
  for (const Action& a : t.actions[std::size_t(s.prank)]) {
    const int stage = a.stage, k = a.micro_batch;
    if (a.op == Op::recv_activation) {
      received[{stage, k}] = s.receive(stage - 1, stage, Channel::activation, stage, k);
    } else if (a.op == Op::send_activation) {
      s.channel->send(take(to_send, a), s.rank_of(stage + 1), tag_of(Channel::activation, stage + 1, k));
    } else {
      const torch::Tensor input = stage == 0 ? batches[std::size_t(k)].input.to(s.device) : take(received, a);
      Autocast autocast(s.options.autocast, s.device.type());
      torch::Tensor out = s.chunks.at(stage)->forward_only(input, 0);
      if (stage == s.last_stage())
        consume(k, out);
      else
        to_send[{stage, k}] = out;
    }
  }
  s.channel->wait_sends();
}

std::vector<double> Pipeline::analytic_bubbles() {
  Impl& s = *impl_;
  std::vector<double> all;
  for (const auto& r : s.recorded) all.insert(all.end(), r.seconds.begin(), r.seconds.end());
  if (!all.empty()) s.pipeline_comm->allreduce(all.data(), all.size(), comm::DType::f64, comm::ReduceOp::sum)->wait();
  std::vector<double> bubble(std::size_t(s.options.pipeline_parallel), 0);
  std::size_t at = 0;
  for (const auto& r : s.recorded) {
    const std::size_t m = std::size_t(r.micro_batches);
    const double* seconds = all.data() + at;
    const Timeline timeline = simulate(s.table(r.micro_batches), [&](const Action& a) {
      return seconds[(std::size_t(a.stage) * 4 + std::size_t(kind_of(a.op))) * m + std::size_t(a.micro_batch)];
    });
    for (std::size_t rank = 0; rank < bubble.size(); ++rank)
      bubble[rank] += timeline.bubble(int(rank)) / double(s.recorded.size());
    at += r.seconds.size();
  }
  s.recorded.clear();
  return bubble;
}

}  // namespace lockstep::pipe
