#include "lockstep/train/datasets.h"

#include <torch/torch.h>

#include "lockstep/data/idx.h"
#include "lockstep/error.h"

namespace lockstep::train {

FashionMnistDataset::FashionMnistDataset(data::FashionMnist::Split split, const std::string& dir,
                                         std::size_t limit)
    : data_(split, dir), size_(limit > 0 ? std::min(limit, data_.size()) : data_.size()) {}

std::size_t FashionMnistDataset::size() const {
  return size_;
}

Batch FashionMnistDataset::get(const std::vector<std::size_t>& indices) const {
  for (std::size_t i : indices)
    if (i >= size_)
      throw DataError("Fashion-MNIST index " + std::to_string(i) + " is past the end (" +
                      std::to_string(size_) + ")");
  data::ImageBatch b = data_.batch(indices);
  const auto n = static_cast<std::int64_t>(b.size());
  auto input = torch::from_blob(b.images.data(), {n, 1, data::FashionMnist::kRows, data::FashionMnist::kCols},
                                torch::kFloat)
                   .sub(kMean)
                   .div_(kStd);  // a new tensor: nothing refers to b's storage afterwards
  auto target = torch::from_blob(b.labels.data(), {n}, torch::kLong).clone();
  return Batch{input, target};
}

}  // namespace lockstep::train
