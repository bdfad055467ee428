// Fuzz target: a Megatron indexed dataset (lockstep/data/token_files.h), as open_indexed reads it.
//
// The input maps to the two files so that valid datasets are reachable: its first byte, read as
// a signed 8-bit number, says how many bytes longer (negative: shorter) the .bin is than the sizes
// in the .idx add up to; the rest of the input is the .idx. The sizes are summed here, from the
// bytes where the layout puts them (dtype code at 17, S at 18, sizes from 34), over the sizes the
// input holds; the .bin is capped at 64 KiB (at 1 MiB the target ran 7x slower, 200 inputs/s).
//
// A dataset it accepts has a .bin exactly as long as its tokens, documents that tile the token
// stream in order, and every token readable.
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "fuzz_input.h"
#include "lockstep/data/token_files.h"

namespace {

constexpr std::uint64_t kMostBinBytes = std::uint64_t{1} << 16;

std::uint64_t little_endian(const std::uint8_t* p, int bytes) {
  std::uint64_t v = 0;
  for (int k = 0; k < bytes; ++k) v |= std::uint64_t{p[k]} << (8 * k);
  return v;
}

// What the index's sizes add up to, in bytes of its dtype (1 for a code it does not know).
std::uint64_t described_bin_bytes(const std::uint8_t* idx, std::size_t size) {
  if (size < 34) return 0;
  const std::uint8_t code = idx[17];
  const std::uint64_t width = code == 4 ? 4 : code == 5 ? 8 : code == 8 ? 2 : 1;
  const std::uint64_t sequences = little_endian(idx + 18, 8);
  std::uint64_t tokens = 0;
  for (std::uint64_t s = 0; s < sequences && 34 + 4 * (s + 1) <= size && tokens < kMostBinBytes; ++s) {
    const auto tokens_in_sequence = static_cast<std::int32_t>(little_endian(idx + 34 + 4 * s, 4));
    if (tokens_in_sequence > 0) tokens += static_cast<std::uint64_t>(tokens_in_sequence);
  }
  return std::min(tokens * width, kMostBinBytes);
}

// The .bin's bytes: a prefix of one pattern made once (filled per input, the loop's coverage
// tracing took half the target's time).
std::vector<std::uint8_t> bin_for(const std::uint8_t* idx, std::size_t size, std::int8_t adjust) {
  static const std::vector<std::uint8_t> pattern = [] {
    std::vector<std::uint8_t> p(kMostBinBytes + 128);
    for (std::size_t k = 0; k < p.size(); ++k) p[k] = static_cast<std::uint8_t>(k * 131 + 7);
    return p;
  }();
  const auto described = static_cast<std::int64_t>(described_bin_bytes(idx, size));
  const auto bytes = static_cast<std::size_t>(std::max<std::int64_t>(0, described + adjust));
  return std::vector<std::uint8_t>(pattern.begin(), pattern.begin() + static_cast<std::ptrdiff_t>(bytes));
}

// The invariants of an accepted dataset; abort() reports a breach.
void check_accepted(const lockstep::data::TokenFile& f, std::size_t bin_bytes) {
  if (f.size() == 0 || f.size() * lockstep::data::token_bytes(f.type()) != bin_bytes) std::abort();
  std::size_t next = 0;
  for (std::size_t d = 0; d < f.documents(); ++d) {
    const lockstep::data::TokenRange r = f.document(d);
    if (r.first != next || r.count > f.size() - r.first) std::abort();
    next = r.first + r.count;
  }
  if (next != f.size()) std::abort();
  std::vector<std::int64_t> tokens(f.size());
  f.copy(0, f.size(), tokens.data());
  if (f.at(f.size() - 1) != tokens.back()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t* idx = data + 1;
  const std::vector<std::uint8_t> bin = bin_for(idx, size - 1, static_cast<std::int8_t>(data[0]));
  const std::string prefix = (lockstep::fuzz::scratch_dir() / "dataset").string();
  lockstep::fuzz::as_file(idx, size - 1, "dataset.idx");
  lockstep::fuzz::as_file(bin.data(), bin.size(), "dataset.bin");
  lockstep::fuzz::parses([&] {
    const lockstep::data::TokenFile f = lockstep::data::TokenFile::open_indexed(prefix);
    check_accepted(f, bin.size());
    lockstep::fuzz::parses([&] {  // a DataError when the corpus is shorter than one block
      if (f.blocks(4).size() != (f.size() - 1) / 4) std::abort();
    });
    f.check_vocabulary(256);  // a DataError for a token outside, nothing else
  });
  return 0;
}
