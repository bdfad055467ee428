// Fashion-MNIST as a Trainer dataset: inputs B x 1 x 28 x 28, normalised with the training set's
// mean and standard deviation; targets the class numbers 0..9.
#pragma once

#include <memory>
#include <string>

#include "lockstep/data/fashion_mnist.h"
#include "lockstep/train/trainer.h"

namespace lockstep::train {

class FashionMnistDataset : public Dataset {
 public:
  static constexpr float kMean = 0.2860f, kStd = 0.3530f;

  // limit > 0 keeps only the first `limit` samples (for quick runs and tests).
  explicit FashionMnistDataset(data::FashionMnist::Split split,
                               const std::string& dir = data::kFashionMnistDir, std::size_t limit = 0);
  std::size_t size() const override;
  Batch get(const std::vector<std::size_t>& indices) const override;
  const data::FashionMnist& raw() const { return data_; }

 private:
  data::FashionMnist data_;
  std::size_t size_;
};

}  // namespace lockstep::train
