#include "lockstep/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>

namespace lockstep::data {
namespace {

std::size_t element_size(IdxType t) {
  switch (t) {
    case IdxType::u8:
    case IdxType::i8: return 1;
    case IdxType::i16: return 2;
    case IdxType::i32:
    case IdxType::f32: return 4;
    case IdxType::f64: return 8;
  }
  return 0;
}

std::string shape_text(const std::vector<std::uint32_t>& dims) {
  std::ostringstream s;
  for (std::size_t i = 0; i < dims.size(); ++i) s << (i ? "x" : "") << dims[i];
  return s.str();
}

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};

}  // namespace

std::size_t IdxArray::count() const {
  std::size_t n = 1;
  for (auto d : dims) n *= d;
  return n;
}

namespace {

// A gzip (or plain) file read whole-buffer at a time; errors name the file.
class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path), file_(gzopen(path.c_str(), "rb")) {
    if (!file_) throw DataError(path + ": cannot open (" + std::strerror(errno) + ")");
    gzbuffer(file_.get(), buffer_size(path));
  }
  // Up to n bytes (fewer only at the end of the file); corrupt gzip is an error, not a short read.
  std::size_t read(void* out, std::size_t n) {
    std::size_t done = 0;
    while (done < n) {
      const int got = gzread(file_.get(), static_cast<char*>(out) + done,
                             static_cast<unsigned>(std::min<std::size_t>(n - done, 1u << 30)));
      int code = Z_OK;
      const char* message = got <= 0 ? gzerror(file_.get(), &code) : "";
      if (got < 0 || (got == 0 && code != Z_OK && code != Z_BUF_ERROR))
        throw DataError(path_ + ": not a valid gzip file (" + message + ")");
      if (got == 0) break;
      done += static_cast<std::size_t>(got);
    }
    return done;
  }

 private:
  // 1 MiB reads for a dataset's tens of MB; no more than the file for a small one (zlib allocates
  // three times this per open).
  static unsigned buffer_size(const std::string& path) {
    std::error_code error;
    const std::uintmax_t size = std::filesystem::file_size(path, error);
    constexpr std::uintmax_t kLargest = 1 << 20, kSmallest = 8 << 10;
    return static_cast<unsigned>(error ? kLargest : std::clamp(size, kSmallest, kLargest));
  }

  std::string path_;
  std::unique_ptr<gzFile_s, GzCloser> file_;
};

std::string hex_byte(std::uint8_t b) {
  char text[8];
  std::snprintf(text, sizeof text, "%02x", b);
  return text;
}

// The magic number and the dimensions, checked.
IdxArray read_header(GzReader& in, const std::string& path) {
  std::uint8_t magic[4];
  if (in.read(magic, 4) != 4) throw DataError(path + ": too short for an IDX file (no 4-byte magic number)");
  if (magic[0] != 0 || magic[1] != 0)
    throw DataError(path + ": not an IDX file (magic number starts with " + std::to_string(magic[0]) + " " +
                    std::to_string(magic[1]) + ", expected 0 0)");
  IdxArray a;
  a.type = static_cast<IdxType>(magic[2]);
  if (element_size(a.type) == 0)
    throw DataError(path + ": unknown IDX element type 0x" + hex_byte(magic[2]) +
                    " (expected 08, 09, 0B, 0C, 0D or 0E)");
  const int ndims = magic[3];
  if (ndims < 1 || ndims > 8)
    throw DataError(path + ": IDX header declares " + std::to_string(ndims) + " dimensions (expected 1..8)");
  for (int i = 0; i < ndims; ++i) {
    std::uint8_t b[4];
    if (in.read(b, 4) != 4)
      throw DataError(path + ": truncated IDX header (dimension " + std::to_string(i + 1) + " missing)");
    a.dims.push_back((std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) | b[3]);
  }
  return a;
}

}  // namespace

namespace {

// The data's size in bytes, or a DataError when the shape's element count overflows or is
// beyond any real dataset's.
std::size_t data_bytes(const IdxArray& a, const std::string& path) {
  constexpr std::size_t kMost = std::size_t{1} << 36;
  std::size_t n = element_size(a.type);
  for (const auto d : a.dims) {
    if (d != 0 && n > kMost / d)
      throw DataError(path + ": IDX header declares an implausible shape " + shape_text(a.dims));
    n *= d;
  }
  return n;
}

// Reads `want` bytes, growing the buffer only as data arrives, in reads that double from 64 KiB
// to 16 MiB: a header that claims more than the file holds costs about what the file holds, not
// what it claims.
std::size_t read_data(GzReader& in, std::vector<std::uint8_t>& out, std::size_t want) {
  constexpr std::size_t kLargestRead = std::size_t{16} << 20;
  std::size_t got = 0;
  for (std::size_t chunk = std::size_t{64} << 10; got < want; chunk = std::min(2 * chunk, kLargestRead)) {
    const std::size_t n = std::min(chunk, want - got);
    out.resize(got + n);
    const std::size_t read = in.read(out.data() + got, n);
    got += read;
    if (read < n) break;
  }
  out.resize(got);
  return got;
}

}  // namespace

IdxArray read_idx(const std::string& path) {
  GzReader in(path);
  IdxArray a = read_header(in, path);
  const std::size_t want = data_bytes(a, path);
  const std::size_t got = read_data(in, a.bytes, want);
  if (got != want)
    throw DataError(path + ": truncated: the header says " + shape_text(a.dims) + " (" + std::to_string(want) +
                    " bytes of data) but the file holds " + std::to_string(got));
  std::uint8_t extra;
  if (in.read(&extra, 1) != 0)
    throw DataError(path + ": has bytes after the " + shape_text(a.dims) + " data its header declares");
  return a;
}

}  // namespace lockstep::data
