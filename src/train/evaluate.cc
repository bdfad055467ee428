#include "evaluate.h"

#include <torch/torch.h>

#include <cmath>
#include <csignal>

#include "lockstep/base/log.h"
#include "lockstep/ddp/autocast.h"
#include "lockstep/data/sampler.h"
#include "lockstep/ddp/comm_dtype.h"
#include "lockstep/error.h"
#include "lockstep/train_core/metrics.h"
#include "dataset_loader.h"
#include "trainer_impl.h"

namespace lockstep::train {

// Rank 0's buffers (BatchNorm running statistics) to every rank, so every rank evaluates the
// model a checkpoint holds. Training forwards update each rank's copy on its own data.
void broadcast_buffers(torch::nn::Module& module, comm::Communicator& comm) {
  if (comm.size() == 1) return;
  torch::NoGradGuard no_grad;
  for (auto& b : module.buffers()) {
    if (!b.defined() || b.numel() == 0) continue;
    const auto dt = comm_dtype_of(b.scalar_type());
    if (!dt) throw ConfigError("cannot broadcast a buffer of type " + dtype_name(b.scalar_type()));
    auto c = b.is_cpu() ? b.contiguous() : b.to(torch::kCPU).contiguous();  // a device's through host memory
    comm.broadcast(c.data_ptr(), static_cast<std::size_t>(c.numel()), *dt, 0)->wait();
    if (!c.is_same(b)) b.copy_(c);
  }
}

data::EvalTotals evaluate_totals(
    const Model& model, const Dataset& dataset, comm::Communicator& comm, const EvalSetup& setup,
    const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss) {
  data::DistributedSampler sampler(dataset.size(), comm.rank(), comm.size(), /*shuffle=*/false);
  // The loader needs shared ownership; the caller keeps the dataset alive for this call.
  std::shared_ptr<const Dataset> ds(&dataset, [](const Dataset*) {});
  auto loader = make_loader(ds, sampler.indices(), setup.batch_size, setup.loader_workers);
  const bool was_training = model.module->is_training();
  model.module->eval();
  torch::NoGradGuard no_grad;
  data::EvalTotals local;
  std::size_t k = 0;
  while (auto batch = loader->next()) {
    const std::int64_t n = batch->target.size(0);
    std::vector<std::int64_t> real;
    for (std::int64_t i = 0; i < n; ++i)
      if (!sampler.is_padding(k + static_cast<std::size_t>(i))) real.push_back(i);
    k += static_cast<std::size_t>(n);
    if (real.empty() && !setup.before_forward) continue;
    if (setup.before_forward) setup.before_forward();
    if (real.empty()) {  // only so the others' gathers have a partner; nothing counted
      Autocast autocast(setup.autocast, setup.device.type());
      model.forward(batch->input.to(setup.device));
      continue;
    }
    torch::Tensor x = batch->input.to(setup.device), y = batch->target.to(setup.device);
    if (static_cast<std::int64_t>(real.size()) != n) {
      auto keep = torch::tensor(real, torch::kLong).to(setup.device);
      x = x.index_select(0, keep);
      y = y.index_select(0, keep);
    }
    torch::Tensor out;
    {
      Autocast autocast(setup.autocast, setup.device.type());
      out = model.forward(x);
    }
    out = loss_input(out);
    // Every target counts once: a sample's label, or each of its tokens.
    local.loss_sum += loss(out, y).item<double>() * static_cast<double>(y.numel());
    local.correct += (setup.predict ? setup.predict(out) : out.argmax(-1)).eq(y).sum().item<std::int64_t>();
    local.count += y.numel();
    local.samples += y.size(0);
  }
  model.module->train(was_training);
  return data::allreduce_totals(comm, local);
}

}  // namespace lockstep::train

// ----- the Trainer's evaluation -------------------------------------------------------------

namespace lockstep::train {

nlohmann::json Trainer::Impl::evaluate() {
  if (!eval_set) throw ConfigError("evaluation needs an eval dataset: pass one to the Trainer");
  step.meet_machines();
  const auto begin = Clock::now();
  broadcast_buffers(*model.module, *comm);
  if (fault("kill-during-eval", state.global_step)) std::raise(SIGKILL);
  const data::EvalTotals total =
      step.pipeline() ? step.pipeline_eval_totals()
               : evaluate_totals(model, *eval_set, data_communicator(),
                                 {args.per_device_eval_batch_size, args.dataloader_num_workers, autocast_dtype(),
                                  step.stage3() ? std::function<void()>([this] { step.zero()->before_forward(); })
                                                : nullptr,
                                  device, predict_fn},
                                 loss_fn);
  metrics::EvalLog m;
  m.step = state.global_step;
  m.epoch = state.fractional_epoch();
  m.eval_loss = total.mean_loss();
  m.eval_accuracy = total.accuracy();
  m.eval_samples = total.samples;
  if (total.count > total.samples) {  // several targets per sample: a language model's tokens
    m.eval_tokens = total.count;
    m.eval_perplexity = std::exp(total.mean_loss());
  }
  m.eval_seconds = seconds_between(begin, Clock::now());
  const nlohmann::json record = m.to_json();
  if (trace()) trace()->span("evaluate", 1, begin, Clock::now(), record);
  return record;
}

// Called inside train(): records the metric, logs, runs the callbacks.
void Trainer::Impl::evaluate_during_training(TrainerControl& control) {
  const nlohmann::json m = evaluate();
  const double value = m.at(args.metric_for_best_model).get<double>();
  const bool greater = args.best_is_greater();
  if (state.offer_metric(value, greater)) checkpoints.set_improved_since_save(true);
  if (rank() == 0)
    LOCKSTEP_LOG(info, train) << "eval @ step " << state.global_step << ": loss " << m["eval_loss"].get<double>()
                              << (m.contains("eval_perplexity")
                                      ? ", perplexity " + std::to_string(m["eval_perplexity"].get<double>())
                                      : std::string())
                              << ", accuracy " << m["eval_accuracy"].get<double>() << " ("
                              << m["eval_samples"].get<std::int64_t>() << " samples)";
  log(m);
  for (auto& cb : callbacks) cb->on_evaluate(state, m, control);
}

}  // namespace lockstep::train
