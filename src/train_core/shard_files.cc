// Sharded checkpoint files (see sharded_checkpoint.h and docs/checkpoint-format.md).
#include "lockstep/train_core/shard_files.h"

#include "lockstep/train_core/checkpoint_dir.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "lockstep/error.h"
#include "lockstep/train_core/durable_file.h"
#include "lockstep/train_core/json_integer.h"

namespace fs = std::filesystem;

namespace lockstep::train {
namespace {

constexpr const char* kFormat = "lockstep-sharded-checkpoint";
constexpr int kVersion = 1;

// CRC-32C (Castagnoli), the checksum of each shard: the CPU's crc32 instruction on three streams
// where it has one, else a table.
std::uint32_t crc32c_table_step(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  static const auto table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
  return crc;
}

// Appending n zero bytes to a message turns its CRC register r into M^(8n) r, M being the
// one-bit step of the register (a 32 x 32 matrix over GF(2), stored as its columns). The CRC of
// A then B is the register after A moved past B's bytes, xor B's own (both from the same start).
using Gf2Matrix = std::array<std::uint32_t, 32>;

std::uint32_t gf2_apply(const Gf2Matrix& m, std::uint32_t v) {
  std::uint32_t out = 0;
  for (int bit = 0; v != 0; ++bit, v >>= 1)
    if (v & 1) out ^= m[static_cast<std::size_t>(bit)];
  return out;
}

Gf2Matrix gf2_square(const Gf2Matrix& m) {
  Gf2Matrix out{};
  for (std::size_t bit = 0; bit < 32; ++bit) out[bit] = gf2_apply(m, m[bit]);
  return out;
}

// The finished CRC-32C of A followed by B, from A's and B's finished CRCs and B's length.
std::uint32_t crc32c_concat(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t length_b) {
  Gf2Matrix step{};  // one zero bit: shift right, the polynomial folded in when bit 0 falls out
  step[0] = 0x82f63b78u;
  for (std::size_t bit = 1; bit < 32; ++bit) step[bit] = 1u << (bit - 1);
  Gf2Matrix power = gf2_square(gf2_square(gf2_square(step)));  // one zero byte
  for (std::size_t n = length_b; n != 0; n >>= 1, power = gf2_square(power))
    if (n & 1) crc_a = gf2_apply(power, crc_a);
  return crc_a ^ crc_b;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::uint32_t crc, const unsigned char* p,
                                                              std::size_t n) {
  std::uint64_t c = crc;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, p + i, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  return crc32c_table_step(static_cast<std::uint32_t>(c), p + i, n - i);
}

// Three streams at once: each crc32 instruction waits for the one before it on the same stream
// (3 cycles) but not for the others', so three thirds run in the time of one, then are joined.
// Takes and returns the raw register, as crc32c_sse42 does.
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42_3way(std::uint32_t reg, const unsigned char* p,
                                                                   std::size_t n) {
  const std::size_t third = (n / 3) & ~std::size_t{7};
  if (third < 4096) return crc32c_sse42(reg, p, n);
  std::uint64_t a = reg, b = 0xffffffffu, c = 0xffffffffu;
  const unsigned char *pa = p, *pb = p + third, *pc = p + 2 * third;
  for (std::size_t i = 0; i < third; i += 8) {
    std::uint64_t wa, wb, wc;
    std::memcpy(&wa, pa + i, 8);
    std::memcpy(&wb, pb + i, 8);
    std::memcpy(&wc, pc + i, 8);
    a = __builtin_ia32_crc32di(a, wa);
    b = __builtin_ia32_crc32di(b, wb);
    c = __builtin_ia32_crc32di(c, wc);
  }
  const std::size_t rest = n - 3 * third;
  const auto last = crc32c_sse42(static_cast<std::uint32_t>(c), pc + third, rest);
  const std::uint32_t ab = crc32c_concat(~static_cast<std::uint32_t>(a), ~static_cast<std::uint32_t>(b), third);
  return ~crc32c_concat(ab, ~last, third + rest);
}
#endif

std::uint32_t crc32c_update(std::uint32_t crc, const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  crc = hardware ? crc32c_sse42_3way(crc, p, n) : crc32c_table_step(crc, p, n);
#else
  crc = crc32c_table_step(crc, p, n);
#endif
  return ~crc;
}

// A shard file mapped read-only: reading it costs no copy into a buffer of our own.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      throw DataError("cannot read " + path + " (a shard of a sharded checkpoint): " + std::strerror(errno) +
                      "; every rank's shard must be in the checkpoint directory");
    struct stat st{};
    if (::fstat(fd, &st) == 0) size_ = std::size_t(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        throw DataError("cannot map " + path + " (a shard of a sharded checkpoint): " + std::strerror(err));
      }
      data_ = static_cast<const char*>(p);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<char*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const char* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  const char* data_ = nullptr;
  std::size_t size_ = 0;
};

// Appends to a file, keeping a running CRC-32C; fsync and close at finish(). Every kFlushBytes it
// writes the range out and drops it from the page cache: a shard is written once and read by
// another process later, and under a memory limit (a container, a cgroup) its dirty pages would
// count against the job, which then thrashes or is killed while it saves.
class ShardOut {
 public:
  explicit ShardOut(std::string path) : file_(std::move(path)) {}

  std::uint64_t write(const void* data, std::size_t bytes) {
    const std::uint64_t at = written_;
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t done = 0; done < bytes;) {
      const std::size_t n = file_.write_some(p + done, std::min<std::size_t>(bytes - done, kFlushBytes));
      crc_ = crc32c_update(crc_, p + done, n);
      done += n;
      written_ += n;
      if (written_ - flushed_ >= kFlushBytes) flush_written();
    }
    return at;
  }
  void finish() { file_.sync_and_close(/*drop_from_cache=*/true); }
  std::uint64_t size() const { return written_; }
  std::uint32_t crc() const { return crc_; }

 private:
  static constexpr std::size_t kFlushBytes = 64u << 20;

  void flush_written() {
    const auto from = static_cast<off_t>(flushed_), length = static_cast<off_t>(written_ - flushed_);
    if (::sync_file_range(file_.fd(), from, length,
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) != 0)
      throw_write_error(file_.path(), errno);
    ::posix_fadvise(file_.fd(), from, length, POSIX_FADV_DONTNEED);
    flushed_ = written_;
  }

  OutputFile file_;
  std::uint64_t written_ = 0, flushed_ = 0;
  std::uint32_t crc_ = 0;
};

nlohmann::json tensor_json(const CheckpointTensor& t) {
  return {{"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}, {"buffer", t.buffer}};
}

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t n) {
  return crc32c_update(0, data, n);
}

std::int64_t CheckpointTensor::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "float32" || dtype == "int32") return 4;
  if (dtype == "float64" || dtype == "int64") return 8;
  if (dtype == "float16" || dtype == "bfloat16" || dtype == "int16") return 2;
  if (dtype == "uint8" || dtype == "int8" || dtype == "bool") return 1;
  throw DataError("a checkpoint tensor has dtype '" + dtype + "', which lockstep does not know");
}

nlohmann::json write_shard_file(const std::string& path, const std::vector<CheckpointTensor>& tensors,
                                const std::vector<ShardPiece>& pieces) {
  ShardOut out(path);
  nlohmann::json entries = nlohmann::json::array();
  for (const auto& p : pieces) {
    const std::size_t bytes = std::size_t(p.count) * dtype_bytes(tensors.at(std::size_t(p.tensor)).dtype);
    nlohmann::json offsets = nlohmann::json::object();
    for (const auto& [name, data] : p.arrays) offsets[name] = out.write(data, bytes);
    entries.push_back({{"tensor", p.tensor}, {"start", p.start}, {"count", p.count}, {"offsets", offsets}});
  }
  out.finish();
  return {{"file", fs::path(path).filename().string()},
          {"bytes", out.size()},
          {"crc32c", out.crc()},
          {"pieces", entries}};
}

std::string sharded_index(const std::vector<CheckpointTensor>& tensors,
                          const std::vector<nlohmann::json>& shards, const nlohmann::json& extra) {
  nlohmann::json index = {{"format", kFormat},
                          {"version", kVersion},
                          {"tensors", nlohmann::json::array()},
                          {"shards", shards},
                          {"extra", extra}};
  for (const auto& t : tensors) index["tensors"].push_back(tensor_json(t));
  return index.dump(1);
}

namespace {

// What an index may claim, checked before anything is read through it: a reader trusts no number
// in the file (it may be damaged, or written by something else).
constexpr std::uint64_t kMostBytes = std::uint64_t{1} << 62;

std::uint64_t checked_bytes(const CheckpointTensor& t) {
  const std::uint64_t esize = dtype_bytes(t.dtype);
  std::uint64_t n = esize;
  for (const auto d : t.shape) {
    if (d < 0) throw DataError("tensor '" + t.name + "' has a negative dimension");
    if (d != 0 && n > kMostBytes / std::uint64_t(d)) throw DataError("tensor '" + t.name + "' is implausibly large");
    n *= std::uint64_t(d);
  }
  return n;
}

// A shard's file name must name a file in the checkpoint's own directory.
std::string checked_file_name(const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos)
    throw DataError("a shard's file name '" + name + "' is not a plain file name in the checkpoint's directory");
  return name;
}

// The index's format and version, read without trusting their types.
void check_format(const nlohmann::json& index, const std::string& path) {
  const auto field = [&](const char* key) {
    return index.is_object() && index.contains(key) ? index.at(key) : nlohmann::json();
  };
  const nlohmann::json format = field("format"), version = field("version");
  if (format == kFormat && version.is_number_integer() && version.get<std::int64_t>() <= kVersion) return;
  throw DataError(path + " is not a lockstep sharded checkpoint of version " + std::to_string(kVersion) +
                  " or older: it says format " + format.dump() + ", version " + version.dump());
}

}  // namespace

ShardedCheckpointReader::ShardedCheckpointReader(const std::string& dir) : dir_(dir) {
  const std::string path = CheckpointDir(dir).index();
  const nlohmann::json index = read_json_file(path, "the index of a sharded checkpoint");
  check_format(index, path);
  try {
    for (const auto& t : index.at("tensors")) {
      tensors_.push_back({t.at("name"), json_integers<std::int64_t>(t.at("shape"), "a tensor's shape"), t.at("dtype"),
                          t.value("buffer", false)});
    }
    extra_ = index.value("extra", nlohmann::json::object());
    pieces_.resize(tensors_.size());
    for (const auto& s : index.at("shards")) {
      shards_.push_back({checked_file_name(s.at("file").get<std::string>()),
                         json_integer<std::uint64_t>(s.at("bytes"), "a shard's size"),
                         json_integer<std::uint32_t>(s.at("crc32c"), "a shard's CRC-32C")});
      for (const auto& p : s.at("pieces")) add_piece(p, static_cast<int>(shards_.size()) - 1);
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataError(path + " lacks a field a sharded checkpoint's index must have, or has one of the wrong type (" +
                    e.what() + "): the file is damaged; use another checkpoint");
  } catch (const DataError& e) {
    throw DataError(path + ": " + e.what() + ": the file is damaged; use another checkpoint");
  }
  for (auto& list : pieces_)
    std::sort(list.begin(), list.end(), [](const Piece& a, const Piece& b) { return a.start < b.start; });
}

// One piece of the index, checked: its tensor is listed, its elements lie inside the tensor and
// every array of it inside its shard's bytes.
void ShardedCheckpointReader::add_piece(const nlohmann::json& p, int shard) {
  const auto tensor = json_integer<std::size_t>(p.at("tensor"), "a piece's tensor");
  if (tensor >= tensors_.size())
    throw DataError("a piece names tensor " + std::to_string(tensor) + " of the " + std::to_string(tensors_.size()) +
                    " it lists");
  const CheckpointTensor& t = tensors_[tensor];
  const std::uint64_t esize = dtype_bytes(t.dtype), numel = checked_bytes(t) / esize;
  Piece piece{shard, json_integer<std::int64_t>(p.at("start"), "a piece's start"),
              json_integer<std::int64_t>(p.at("count"), "a piece's count"), {}};
  if (piece.start < 0 || piece.count < 0 || std::uint64_t(piece.start) > numel ||
      std::uint64_t(piece.count) > numel - std::uint64_t(piece.start))
    throw DataError("a piece of '" + t.name + "' lies outside its " + std::to_string(numel) + " elements");
  const std::uint64_t bytes = std::uint64_t(piece.count) * esize, shard_bytes = shards_.back().bytes;
  for (const auto& [name, at] : p.at("offsets").items()) {
    const auto offset = json_integer<std::uint64_t>(at, "the offset of '" + name + "'");
    if (offset > shard_bytes || bytes > shard_bytes - offset)
      throw DataError("the '" + name + "' array of a piece of '" + t.name + "' lies outside its shard's " +
                      std::to_string(shard_bytes) + " bytes");
    piece.offsets[name] = offset;
  }
  pieces_[tensor].push_back(std::move(piece));
}

int ShardedCheckpointReader::find(const std::string& name) const {
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    if (tensors_[i].name == name) return static_cast<int>(i);
  return -1;
}

bool ShardedCheckpointReader::has(int tensor, const std::string& array) const {
  for (const auto& p : pieces_.at(std::size_t(tensor)))
    if (p.offsets.count(array)) return true;
  return false;
}

const ShardedCheckpointReader::Mapped& ShardedCheckpointReader::bytes_of(int shard) {
  auto it = loaded_.find(shard);
  if (it != loaded_.end()) return *it->second;
  const Shard& entry = shards_.at(std::size_t(shard));
  const std::string path = (fs::path(dir_) / entry.file).string();
  auto file = std::make_shared<MappedFile>(path);
  const std::uint64_t want = entry.bytes;
  if (file->size() != want)
    throw DataError(path + " holds " + std::to_string(file->size()) + " bytes where the index says " +
                    std::to_string(want) + ": the shard is truncated or replaced; use another checkpoint");
  if (crc32c_update(0, file->data(), file->size()) != entry.crc32c)
    throw DataError(path + " does not match its CRC-32C in the index: the shard is damaged; use another checkpoint");
  auto mapped = std::make_shared<Mapped>(Mapped{file->data(), file->size(), file});
  return *loaded_.emplace(shard, std::move(mapped)).first->second;
}

void ShardedCheckpointReader::read(int tensor, const std::string& array, std::int64_t start,
                                   std::int64_t count, void* out) {
  const auto& t = tensors_.at(std::size_t(tensor));
  const std::size_t esize = dtype_bytes(t.dtype);
  const std::int64_t end = start + count;
  const auto& pieces = pieces_.at(std::size_t(tensor));
  // Copies from the pieces from `first` on (sorted by start) while they continue the range;
  // returns how far it got.
  auto copy_from = [&](std::vector<Piece>::const_iterator first) {
    std::int64_t at = start;
    for (auto it = first; it != pieces.end() && at < end; ++it) {
      const Piece& p = *it;
      if (p.start + p.count <= at || p.start >= end) continue;
      if (p.start > at) break;  // a gap: nobody wrote element `at`
      auto off = p.offsets.find(array);
      if (off == p.offsets.end()) break;
      const std::int64_t to = std::min(end, p.start + p.count);
      const Mapped& bytes = bytes_of(p.shard);
      const std::uint64_t from = off->second + std::uint64_t(at - p.start) * esize;
      const std::uint64_t n = std::uint64_t(to - at) * esize;
      if (from + n > bytes.size)
        throw DataError("shard " + shards_.at(std::size_t(p.shard)).file + " of " + dir_ +
                        " is shorter than its index says: use another checkpoint");
      std::memcpy(static_cast<char*>(out) + std::size_t(at - start) * esize, bytes.data + from, n);
      at = to;
    }
    return at;
  };
  // From the first piece that reaches `start`, found by binary search: a tensor cut by columns has
  // a piece per row, and a resume reads it a range at a time. An index whose pieces overlap (none
  // that lockstep writes) is read from its first piece, as a scan would.
  auto first = std::lower_bound(pieces.begin(), pieces.end(), start,
                                [](const Piece& p, std::int64_t value) { return p.start < value; });
  while (first != pieces.begin() && std::prev(first)->start + std::prev(first)->count > start) --first;
  std::int64_t at = copy_from(first);
  if (at < end && first != pieces.begin()) at = copy_from(pieces.begin());
  if (at >= end || count == 0) return;
  throw DataError("sharded checkpoint " + dir_ + " has no '" + array + "' for elements " + std::to_string(at) +
                  ".. of '" + t.name + "': a shard is missing from its index; use another checkpoint");
}

}  // namespace lockstep::train
