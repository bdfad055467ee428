// Fashion-MNIST (70,000 28x28 grey images of clothing in 10 classes), read from the IDX files of
// Debian's dataset-fashion-mnist package by default, or from any directory holding the four files
// (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-...).
//
// Loaded whole into memory (47 MB for train) at construction; read-only afterwards, so any number
// of loader threads may call image()/label() at once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::data {

// A batch as the trainer consumes it: images as floats in [0, 1], B x 28 x 28 row-major, ready to
// wrap in a tensor without copying; labels 0..9; and the dataset indices, for evaluation.
struct ImageBatch {
  std::vector<float> images;
  std::vector<std::int64_t> labels;
  std::vector<std::size_t> indices;
  std::size_t size() const { return labels.size(); }
};

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

class FashionMnist {
 public:
  enum class Split { train, test };
  static constexpr int kRows = 28, kCols = 28, kPixels = kRows * kCols, kClasses = 10;

  // Throws DataError naming the file and the problem; a missing dataset names the package.
  explicit FashionMnist(Split split, const std::string& dir = kFashionMnistDir);

  std::size_t size() const { return labels_.size(); }
  const std::uint8_t* image(std::size_t i) const { return pixels_.data() + i * kPixels; }
  int label(std::size_t i) const { return labels_[i]; }

  static const char* class_name(int label);
  // Builds the batch of these indices (safe to call from several threads at once).
  ImageBatch batch(const std::vector<std::size_t>& indices) const;

 private:
  std::vector<std::uint8_t> pixels_;
  std::vector<std::uint8_t> labels_;
};

}  // namespace lockstep::data
