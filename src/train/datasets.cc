#include "lockstep/train/datasets.h"

#include <torch/torch.h>

#include <filesystem>

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

namespace {

void check_indices(const std::vector<std::size_t>& indices, std::size_t size, const char* what) {
  for (std::size_t i : indices)
    if (i >= size)
      throw DataError(std::string(what) + " index " + std::to_string(i) + " is past the end (" + std::to_string(size) + ")");
}

}  // namespace

LanguageModelDataset::LanguageModelDataset(std::shared_ptr<const data::FortuneCorpus> corpus, data::TextSplit split,
                                           int block_size, std::size_t limit)
    : corpus_(std::move(corpus)), blocks_(*corpus_, split, block_size) {
  size_ = limit > 0 ? std::min(limit, blocks_.size()) : blocks_.size();
}

Batch LanguageModelDataset::get(const std::vector<std::size_t>& indices) const {
  check_indices(indices, size_, "text block");
  const auto n = static_cast<std::int64_t>(indices.size());
  const auto t = static_cast<std::int64_t>(blocks_.block_size());
  auto tokens = torch::empty({n, t + 1}, torch::kLong);
  auto* out = tokens.data_ptr<std::int64_t>();
  for (std::int64_t row = 0; row < n; ++row) {
    const std::uint8_t* block = blocks_.block(indices[static_cast<std::size_t>(row)]);
    for (std::int64_t j = 0; j <= t; ++j) out[row * (t + 1) + j] = block[j];
  }
  using torch::indexing::Slice;
  return Batch{tokens.index({Slice(), Slice(0, t)}).contiguous(), tokens.index({Slice(), Slice(1, t + 1)}).contiguous()};
}

namespace {

data::TokenFile open_token_file(const std::string& path, std::int64_t vocab_size) {
  if (vocab_size < 1) throw ConfigError("a token file needs a vocabulary of at least one token (--vocab-size)");
  const auto vocab = static_cast<std::uint64_t>(vocab_size);
  data::TokenFile file = std::filesystem::exists(path + ".idx")
                             ? data::TokenFile::open_indexed(path)
                             : data::TokenFile::open_flat(path, data::token_width_for(vocab));
  file.check_vocabulary(vocab);
  return file;
}

}  // namespace

TokenFileDataset::TokenFileDataset(const std::string& path, std::int64_t vocab_size, int block_size,
                                   std::size_t limit)
    : blocks_(open_token_file(path, vocab_size).blocks(block_size)) {
  size_ = limit > 0 ? std::min(limit, blocks_.size()) : blocks_.size();
}

Batch TokenFileDataset::get(const std::vector<std::size_t>& indices) const {
  check_indices(indices, size_, "token block");
  const auto n = static_cast<std::int64_t>(indices.size()), t = static_cast<std::int64_t>(blocks_.block_size());
  auto input = torch::empty({n, t}, torch::kLong), target = torch::empty({n, t}, torch::kLong);
  blocks_.copy_batch(indices, input.data_ptr<std::int64_t>(), target.data_ptr<std::int64_t>());
  return Batch{input, target};
}

TextClassificationDataset::TextClassificationDataset(std::shared_ptr<const data::FortuneCorpus> corpus,
                                                     data::TextSplit split, int block_size, std::size_t min_entries,
                                                     std::size_t limit)
    : corpus_(std::move(corpus)), labels_(*corpus_, split, min_entries), block_size_(block_size) {
  size_ = limit > 0 ? std::min(limit, labels_.size()) : labels_.size();
}

Batch TextClassificationDataset::get(const std::vector<std::size_t>& indices) const {
  check_indices(indices, size_, "text entry");
  const auto n = static_cast<std::int64_t>(indices.size()), t = static_cast<std::int64_t>(block_size_);
  auto input = torch::full({n, t}, static_cast<std::int64_t>(data::kPadByte), torch::kLong);
  auto target = torch::empty({n}, torch::kLong);
  auto* in = input.data_ptr<std::int64_t>();
  for (std::int64_t row = 0; row < n; ++row) {
    const std::size_t i = indices[static_cast<std::size_t>(row)];
    const std::string& text = labels_.text(i);
    const std::int64_t len = std::min<std::int64_t>(t, static_cast<std::int64_t>(text.size()));
    for (std::int64_t j = 0; j < len; ++j) in[row * t + j] = static_cast<unsigned char>(text[static_cast<std::size_t>(j)]);
    target[row] = labels_.label(i);
  }
  return Batch{input, target};
}

}  // namespace lockstep::train
