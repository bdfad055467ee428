// The safetensors format (Hugging Face's weight files), read and written without torch.
//
// A file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype
// ("F32", "BF16", ...), shape and byte range [begin, end) in the data that follows, and the data.
//
//   SafetensorsFile f = read_safetensors("model.safetensors");   // DataError naming what is wrong
//   const SafeTensor& w = f.at("transformer.wte.weight");        // DataError naming missing ones
//   write_safetensors("out.safetensors", {{"w", w}}, {{"format", "pt"}});  // whole file or none
//
// Reading checks what a reader must trust: the header fits the file, every range lies inside the
// data, matches its shape and dtype, and no two ranges overlap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lockstep::train {

struct SafeTensor {
  std::string dtype;                // "F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"
  std::vector<std::int64_t> shape;  // [] is a scalar
  std::string_view bytes;           // numel * element size bytes, little-endian

  std::int64_t numel() const;
};

// Bytes per element of a safetensors dtype; DataError for a dtype this reader does not know.
std::size_t safetensors_element_size(const std::string& dtype);

class SafetensorsFile {
 public:
  // Parses a whole file's bytes (kept by the object); `name` is used in errors.
  SafetensorsFile(std::string bytes, std::string name);

  const SafeTensor& at(const std::string& tensor) const;  // DataError naming the file and the tensor
  bool contains(const std::string& tensor) const { return tensors_.count(tensor) != 0; }
  const std::map<std::string, SafeTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::unique_ptr<const std::string> bytes_;  // the views point into it; it stays put when moved
  std::string name_;
  std::map<std::string, SafeTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

SafetensorsFile read_safetensors(const std::string& path);

// A directory's weights in Hugging Face's layouts: model.safetensors, or the shards that
// model.safetensors.index.json maps each tensor to. DataError, naming the file, for a broken
// index, a shard missing or outside the directory, a tensor the index maps to a shard that lacks
// it, or a name held by two shards.
class SafetensorsDir {
 public:
  explicit SafetensorsDir(const std::string& dir);

  // Every tensor by name, whichever file holds it.
  const std::map<std::string, const SafeTensor*>& tensors() const { return tensors_; }

 private:
  void read_shards(const std::string& dir, const std::string& index);
  void add(std::unique_ptr<SafetensorsFile> file, const std::string& path);

  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafeTensor*> tensors_;
  std::map<std::string, std::string> file_of_;  // tensor -> the file that holds it, for errors
};

// Serialises tensors in the order given (the header padded to 8 bytes, as Hugging Face's writer does).
std::string encode_safetensors(const std::vector<std::pair<std::string, SafeTensor>>& tensors,
                               const std::map<std::string, std::string>& metadata = {});
// Writes the file durably (durable_file.h): a reader sees the old file or the whole new one.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, SafeTensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace lockstep::train
