// Fuzz target: a sharded checkpoint's index.json (docs/checkpoint-format.md), read beside one
// real shard file, and every tensor's first elements read back through it as a resuming run
// would. A shard the index names must be inside the checkpoint, and a read must stay inside the
// shard and the caller's buffer (AddressSanitizer watches both).
#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "lockstep/train_core/shard_files.h"

namespace {
constexpr std::int64_t kMostElements = 64;  // read per tensor and array

// The shard a seed's index describes: 256 bytes, 0, 1, 2, ...
void write_shard() {
  static const bool written = [] {
    std::vector<std::uint8_t> bytes(256);
    for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>(i);
    lockstep::fuzz::as_file(bytes.data(), bytes.size(), "checkpoint/shard-0-of-1.bin");
    return true;
  }();
  (void)written;
}

void read_every_tensor(lockstep::train::ShardedCheckpointReader& reader) {
  const auto& tensors = reader.tensors();
  for (std::size_t i = 0; i < std::min<std::size_t>(tensors.size(), 8); ++i) {
    const int t = static_cast<int>(i);
    const std::size_t esize = lockstep::train::dtype_bytes(tensors[i].dtype);
    const std::int64_t count = std::min(tensors[i].numel(), kMostElements);
    if (count <= 0) continue;
    for (const char* array : {"value", "exp_avg"}) {
      if (!reader.has(t, array)) continue;
      std::vector<char> out(static_cast<std::size_t>(count) * esize);
      reader.read(t, array, 0, count, out.data());
    }
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::filesystem::create_directories(lockstep::fuzz::scratch_dir() / "checkpoint");
  write_shard();
  lockstep::fuzz::as_file(data, size, "checkpoint/index.json");
  const std::string dir = (lockstep::fuzz::scratch_dir() / "checkpoint").string();
  lockstep::fuzz::parses([&] {
    lockstep::train::ShardedCheckpointReader reader(dir);
    read_every_tensor(reader);
  });
  return 0;
}
