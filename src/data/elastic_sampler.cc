#include "lockstep/data/elastic_sampler.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "lockstep/error.h"

namespace lockstep::data {

ElasticSampler::ElasticSampler(std::size_t dataset_size, std::size_t global_batch, bool shuffle, std::uint64_t seed)
    : global_batch_(global_batch), shuffle_(shuffle), seed_(seed), order_(dataset_size) {
  if (global_batch == 0) throw ConfigError("ElasticSampler: the global batch must be at least 1 sample");
  if (dataset_size == 0) throw ConfigError("ElasticSampler: the dataset is empty");
  set_epoch(0);
}

void ElasticSampler::set_epoch(std::uint64_t epoch) {
  state_ = SamplerState{epoch, 0};
  if (shuffle_) {
    order_ = epoch_permutation(order_.size(), seed_, epoch);
  } else {
    std::iota(order_.begin(), order_.end(), std::size_t{0});
  }
}

std::size_t ElasticSampler::step_size() const {
  return std::min(global_batch_, order_.size() - std::min(order_.size(), state_.position));
}

StepShare ElasticSampler::share(int rank, int world) const {
  if (world < 1 || rank < 0 || rank >= world)
    throw ConfigError("ElasticSampler: rank " + std::to_string(rank) + " is not in a world of " +
                      std::to_string(world));
  StepShare s;
  s.step_samples = step_size();
  const std::size_t end = state_.position + s.step_samples;
  for (std::size_t p = state_.position + static_cast<std::size_t>(rank); p < end; p += static_cast<std::size_t>(world))
    s.indices.push_back(order_[p]);
  return s;
}

void ElasticSampler::advance() {
  state_.position += step_size();
}

void ElasticSampler::load_state(const SamplerState& state) {
  if (state.position > order_.size())
    throw ConfigError("ElasticSampler: saved position " + std::to_string(state.position) + " is past the " +
                      std::to_string(order_.size()) + " samples of an epoch: the state was made for another dataset");
  if (state.epoch != state_.epoch) set_epoch(state.epoch);
  state_.position = state.position;
}

}  // namespace lockstep::data
