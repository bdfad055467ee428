// Sharded checkpoints on disk: each rank writes the part of the training state it holds into a file of
// its own, and a reader of any world size reads back whatever part it needs. Torch-free: pieces
// are pointers, element sizes and names; the train layer maps tensors onto them.
//
// What is stored. The checkpoint's tensors (parameters, then buffers), each with a name, shape
// and dtype. A shard file holds pieces: a contiguous element range of one tensor, as one array
// per kind of data ("value", and for trainable parameters the optimizer's per-element state such
// as "exp_avg" and "exp_avg_sq"). Every element of every tensor is in exactly one piece of one
// shard; which rank wrote which range does not matter to a reader.
//
// Files in the checkpoint directory (checkpoint_dir.h names them; format in docs/checkpoint-format.md):
//   shard-<r>-of-<W>.bin   the arrays, raw, little-endian, one after the other
//   index.json             the tensors, every shard's pieces with the byte offset of each array,
//                          each file's size and CRC-32C, and what the caller adds (optimizer kind,
//                          step count, ...), written last: a directory without it is no checkpoint.
//
// Errors: a shard that is missing, truncated or damaged (size or CRC-32C differs from the index),
// an index that does not parse, or a range nobody wrote is a DataError naming the file and what
// is wrong. Writing: a StorageError naming the path (a full disk).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lockstep::train {

struct CheckpointTensor {
  std::string name;                 // "fc1.weight"
  std::vector<std::int64_t> shape;  // {512, 784}
  std::string dtype;                // "float32", "float64", "int64", ... (as dtype_bytes knows)
  bool buffer = false;              // a buffer (BatchNorm statistics), not a trainable parameter
  std::int64_t numel() const;
};

// CRC-32C (Castagnoli) of `n` bytes: the checksum of every shard file in the index.
std::uint32_t crc32c(const void* data, std::size_t n);

// Bytes per element of a dtype name; DataError for one it does not know.
std::size_t dtype_bytes(const std::string& dtype);

// One piece a rank writes: elements [start, start + count) of tensor `tensor`, an array per kind.
struct ShardPiece {
  int tensor = 0;
  std::int64_t start = 0, count = 0;
  std::map<std::string, const void*> arrays;  // "value" -> count elements of the tensor's dtype, ...
};

// Writes `pieces` to `path` (flushed to disk) and returns its entry for the index.
nlohmann::json write_shard_file(const std::string& path, const std::vector<CheckpointTensor>& tensors,
                                const std::vector<ShardPiece>& pieces);

// index.json's text: the tensors, the shards' entries (in rank order) and `extra` (kept as is).
std::string sharded_index(const std::vector<CheckpointTensor>& tensors,
                          const std::vector<nlohmann::json>& shards, const nlohmann::json& extra);

// Reads a sharded checkpoint. Each shard file is mapped (and its CRC-32C checked) the first time a
// piece of it is needed, and stays mapped while the reader lives.
class ShardedCheckpointReader {
 public:
  explicit ShardedCheckpointReader(const std::string& dir);
  const std::vector<CheckpointTensor>& tensors() const { return tensors_; }
  const nlohmann::json& extra() const { return extra_; }
  int world() const { return static_cast<int>(shards_.size()); }
  // The tensor's index, or -1.
  int find(const std::string& name) const;
  // Whether any piece of the tensor carries `array`.
  bool has(int tensor, const std::string& array) const;
  // Elements [start, start + count) of `array` of tensor `tensor` into `out` (count x its dtype's
  // bytes), gathered from whichever shards hold them. DataError when some element is missing.
  void read(int tensor, const std::string& array, std::int64_t start, std::int64_t count, void* out);

 private:
  struct Piece {
    int shard = 0;
    std::int64_t start = 0, count = 0;
    std::map<std::string, std::uint64_t> offsets;  // array -> byte offset in the shard file
  };
  struct Mapped {
    const char* data = nullptr;
    std::size_t size = 0;
    std::shared_ptr<void> keep;  // the mapping, undone when the reader goes
  };
  struct Shard {
    std::string file;  // a name in the checkpoint's directory
    std::uint64_t bytes = 0;
    std::uint32_t crc32c = 0;
  };
  void add_piece(const nlohmann::json& piece, int shard);
  const Mapped& bytes_of(int shard);

  std::string dir_;
  std::vector<CheckpointTensor> tensors_;
  nlohmann::json extra_;
  std::vector<Shard> shards_;
  std::vector<std::vector<Piece>> pieces_;  // per tensor, by start
  std::map<int, std::shared_ptr<Mapped>> loaded_;  // shard -> its bytes, mapped
};

}  // namespace lockstep::train
