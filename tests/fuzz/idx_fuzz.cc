// Fuzz target: an IDX file (MNIST's format; gzip-compressed or raw), as read_idx reads it.
// An array it accepts holds exactly as many bytes as its dimensions and type say (counted
// without wrapping: a shape whose product wraps to 0 must not pass as an empty array).
#include <cstdlib>

#include "fuzz_input.h"
#include "lockstep/data/idx.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = lockstep::fuzz::as_file(data, size, "input.idx");
  lockstep::fuzz::parses([&] {
    const lockstep::data::IdxArray a = lockstep::data::read_idx(path);
    std::size_t element = 1;
    switch (a.type) {
      case lockstep::data::IdxType::u8:
      case lockstep::data::IdxType::i8: element = 1; break;
      case lockstep::data::IdxType::i16: element = 2; break;
      case lockstep::data::IdxType::i32:
      case lockstep::data::IdxType::f32: element = 4; break;
      case lockstep::data::IdxType::f64: element = 8; break;
      default: std::abort();  // a type code the reader should have refused
    }
    __extension__ typedef unsigned __int128 Wide;
    Wide want = element;  // wide enough for 8 dimensions of 2^32 - 1: no wrap here
    for (const auto d : a.dims) want *= d;
    if (a.bytes.size() != want) std::abort();
  });
  return 0;
}
