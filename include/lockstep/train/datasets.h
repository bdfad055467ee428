// Datasets as the Trainer consumes them (tensors), over the data layer's readers:
//   FashionMnistDataset        images B x 1 x 28 x 28, normalised; targets the classes 0..9
//   LanguageModelDataset       byte blocks of the fortune corpus: input [B, T], target [B, T] (the
//                              next byte of each)
//   TokenFileDataset           blocks of a tokenized corpus on disk (data/token_files.h): input
//                              [B, T], target [B, T] (the next token of each)
//   TextClassificationDataset  fortune entries padded (0) or cut to T bytes, [B, T]; target [B]
//                              the entry's category
#pragma once

#include <memory>
#include <string>

#include "lockstep/data/fashion_mnist.h"
#include "lockstep/data/text.h"
#include "lockstep/data/token_files.h"
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

class LanguageModelDataset : public Dataset {
 public:
  LanguageModelDataset(std::shared_ptr<const data::FortuneCorpus> corpus, data::TextSplit split, int block_size,
                       std::size_t limit = 0);
  std::size_t size() const override { return size_; }
  Batch get(const std::vector<std::size_t>& indices) const override;
  const data::TokenBlocks& blocks() const { return blocks_; }

 private:
  std::shared_ptr<const data::FortuneCorpus> corpus_;
  data::TokenBlocks blocks_;
  std::size_t size_;
};

class TokenFileDataset : public Dataset {
 public:
  // `path` names a Megatron prefix when path + ".idx" exists, else a flat nanoGPT file whose width
  // the vocabulary gives. Every token is checked against `vocab_size` once, here: a DataError
  // names the first one outside it (its file and byte offset).
  TokenFileDataset(const std::string& path, std::int64_t vocab_size, int block_size, std::size_t limit = 0);
  std::size_t size() const override { return size_; }
  Batch get(const std::vector<std::size_t>& indices) const override;
  const data::TokenFileBlocks& blocks() const { return blocks_; }

 private:
  data::TokenFileBlocks blocks_;
  std::size_t size_;
};

class TextClassificationDataset : public Dataset {
 public:
  TextClassificationDataset(std::shared_ptr<const data::FortuneCorpus> corpus, data::TextSplit split, int block_size,
                            std::size_t min_entries, std::size_t limit = 0);
  std::size_t size() const override { return size_; }
  Batch get(const std::vector<std::size_t>& indices) const override;
  const data::EntryLabels& labels() const { return labels_; }

 private:
  std::shared_ptr<const data::FortuneCorpus> corpus_;
  data::EntryLabels labels_;
  int block_size_;
  std::size_t size_;
};

}  // namespace lockstep::train
