#include "lockstep/data/fashion_mnist.h"

#include <sys/stat.h>

#include "lockstep/data/idx.h"

namespace lockstep::data {
namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// "name.gz" when present, else "name".
std::string find_file(const std::string& dir, const std::string& name) {
  for (const std::string& candidate : {dir + "/" + name + ".gz", dir + "/" + name})
    if (exists(candidate)) return candidate;
  if (!exists(dir))
    throw DataError("Fashion-MNIST not found: " + dir + " does not exist. Install Debian's package " +
                    "(apt-get install dataset-fashion-mnist) or pass the directory that holds the IDX files");
  throw DataError("Fashion-MNIST: " + dir + " has no " + name +
                  "[.gz]. Install Debian's package "
                  "(apt-get install dataset-fashion-mnist) or pass the directory that holds the IDX files");
}

}  // namespace

FashionMnist::FashionMnist(Split split, const std::string& dir) {
  std::string prefix = split == Split::train ? "train" : "t10k";
  std::string images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  std::string labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  IdxArray images = read_idx(images_path);
  IdxArray labels = read_idx(labels_path);
  if (images.type != IdxType::u8 || images.dims.size() != 3 || images.dims[1] != kRows ||
      images.dims[2] != kCols)
    throw DataError(images_path + ": expected unsigned bytes shaped Nx28x28");
  if (labels.type != IdxType::u8 || labels.dims.size() != 1)
    throw DataError(labels_path + ": expected unsigned bytes shaped N");
  if (labels.dims[0] != images.dims[0])
    throw DataError(labels_path + " holds " + std::to_string(labels.dims[0]) + " labels but " + images_path +
                    " holds " + std::to_string(images.dims[0]) + " images");
  for (std::size_t i = 0; i < labels.bytes.size(); ++i)
    if (labels.bytes[i] >= kClasses)
      throw DataError(labels_path + ": label " + std::to_string(labels.bytes[i]) + " at index " +
                      std::to_string(i) + " is outside 0..9");
  pixels_ = std::move(images.bytes);
  labels_ = std::move(labels.bytes);
}

ImageBatch FashionMnist::batch(const std::vector<std::size_t>& indices) const {
  ImageBatch b;
  b.indices = indices;
  b.images.resize(indices.size() * kPixels);
  b.labels.resize(indices.size());
  for (std::size_t k = 0; k < indices.size(); ++k) {
    std::size_t i = indices[k];
    if (i >= size())
      throw DataError("Fashion-MNIST: index " + std::to_string(i) + " is past the " + std::to_string(size()) +
                      " examples");
    const std::uint8_t* px = image(i);
    float* out = b.images.data() + k * kPixels;
    for (int p = 0; p < kPixels; ++p) out[p] = static_cast<float>(px[p]) * (1.0f / 255.0f);
    b.labels[k] = labels_[i];
  }
  return b;
}

const char* FashionMnist::class_name(int label) {
  static const char* kNames[kClasses] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                         "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  return label >= 0 && label < kClasses ? kNames[label] : "?";
}

}  // namespace lockstep::data
