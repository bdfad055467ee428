#include "pipe_runs.h"

#include <cstring>
#include <mutex>

#include "lockstep/ddp/ddp.h"

namespace lockstep::testing {
namespace {

torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), target.reshape({-1}));
}

// torch's default generator is the process's: ranks as threads take turns setting it.
std::mutex generator_mutex;

// Each replica's dropout seeds start where the Trainer starts them (its seed plus the replica).
void seed_replica(int replica) {
  std::lock_guard<std::mutex> lock(generator_mutex);
  torch::manual_seed(1000 + std::uint64_t(replica));
}

torch::optim::AdamW make_optimizer(const std::vector<torch::Tensor>& params) {
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(3e-3).weight_decay(0.1));
}

}  // namespace

std::string PipeRun::describe() const {
  return std::string(pipe::schedule_name(schedule)) + " P " + std::to_string(pipeline) + " v " + std::to_string(chunks) +
         " m " + std::to_string(micro_batches) + " D " + std::to_string(replicas) +
         (split.empty() ? "" : " split " + split) + (dropout > 0 ? " dropout" : "") + (checkpointing ? " checkpointing" : "") +
         (tied_once ? " tied once" : "");
}

models::GptConfig tiny_gpt(double dropout) {
  models::GptConfig c;
  c.vocab_size = 32;
  c.block_size = 8;
  c.n_layer = 6;
  c.n_head = 2;
  c.n_embd = 16;
  c.dropout = dropout;
  return c;
}

models::GptLmHeadModel make_model(const models::GptConfig& config, bool checkpointing) {
  std::lock_guard<std::mutex> lock(generator_mutex);
  torch::manual_seed(7);
  models::GptLmHeadModel model(config);
  model->set_gradient_checkpointing(checkpointing);
  return model;
}

std::vector<pipe::MicroBatch> micro_batches(const PipeRun& run, int replica, int step) {
  const int m = run.micro_batches, total = 2 * m + 1;
  const auto config = tiny_gpt(run.dropout);
  auto gen = at::detail::createCPUGenerator(std::uint64_t(step) * 7919 + std::uint64_t(replica) * 104729 + 1);
  const auto tokens = torch::randint(config.vocab_size, {total, config.block_size + 1}, gen, torch::kLong);
  std::vector<pipe::MicroBatch> out;
  for (int k = 0, first = 0; k < m; ++k) {
    const int size = total / m + (k < total % m ? 1 : 0);
    const auto rows = tokens.narrow(0, first, size);
    out.push_back({rows.narrow(1, 0, config.block_size).contiguous(), rows.narrow(1, 1, config.block_size).contiguous(),
                   double(size) / total});
    first += size;
  }
  return out;
}

Parameters reference_run(const PipeRun& run, comm::Communicator* ddp, int replica) {
  auto model = make_model(tiny_gpt(run.dropout), run.checkpointing);
  model->train();
  std::unique_ptr<Reducer> reducer;
  if (ddp) reducer = std::make_unique<Reducer>(model.ptr(), *ddp, DdpOptions{});
  auto optimizer = make_optimizer(model->parameters());
  seed_replica(replica);
  for (int step = 0; step < run.steps; ++step) {
    const auto batches = micro_batches(run, replica, step);
    for (std::size_t k = 0; k < batches.size(); ++k) {
      if (reducer) {
        reducer->set_sync(k + 1 == batches.size());
        reducer->before_forward();
      }
      torch::Tensor out = model->forward(batches[k].input);
      if (reducer) reducer->after_forward(&out);
      const torch::Tensor loss = cross_entropy(out.to(torch::kFloat), batches[k].target);
      (loss * batches[k].loss_weight).backward();
    }
    if (run.max_grad_norm > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), run.max_grad_norm);
    optimizer.step();
    optimizer.zero_grad();
  }
  Parameters out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

Parameters pipelined_run(const PipeRun& run, comm::Communicator& world) {
  auto model = make_model(tiny_gpt(run.dropout), run.checkpointing);
  model->train();
  pipe::PipelineOptions options;
  options.pipeline_parallel = run.pipeline;
  options.schedule = run.schedule;
  options.virtual_stages = run.chunks;
  options.split = run.split;
  options.balance = pipe::PipelineOptions::Balance::parameters;
  if (run.tied_once) options.tied_gradient = pipe::PipelineOptions::TiedGradient::step;
  const int replica = pipe::PipelineMesh::of(world.size(), run.pipeline).replica_of(world.rank());
  const auto first = micro_batches(run, replica, 0);
  pipe::Pipeline pipeline(model->pipeline_units(), world, options, first.front(), cross_entropy);
  auto optimizer = make_optimizer(pipeline.parameters());
  seed_replica(replica);
  for (int step = 0; step < run.steps; ++step) {
    pipeline.train_step(micro_batches(run, replica, step));
    pipeline.clip_grad_norm(run.max_grad_norm);
    optimizer.step();
    optimizer.zero_grad();
    pipeline.after_optimizer_step();
  }
  Parameters out;
  for (const auto& [name, p] : pipeline.named_parameters()) out[name] = p.detach().clone();
  return out;
}

std::string differing(const Parameters& expected, const Parameters& got, double* max_difference) {
  std::string names;
  double worst = 0;
  for (const auto& [name, t] : got) {
    const auto it = expected.find(name);
    const bool same = it != expected.end() && it->second.sizes() == t.sizes() && it->second.dtype() == t.dtype() &&
                      std::memcmp(it->second.contiguous().data_ptr(), t.contiguous().data_ptr(), t.nbytes()) == 0;
    if (it != expected.end() && it->second.sizes() == t.sizes())
      worst = std::max(worst, (it->second.to(torch::kDouble) - t.to(torch::kDouble)).abs().max().item<double>());
    if (!same) names += (names.empty() ? "" : ", ") + name;
  }
  if (max_difference) *max_difference = worst;
  return names;
}

}  // namespace lockstep::testing
