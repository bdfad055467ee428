// IDX files, the format of MNIST and Fashion-MNIST: a 4-byte magic (two zero bytes, a type
// code, the number of dimensions), each dimension as a big-endian u32, then the elements in
// row-major order. Read gzip-compressed or raw (zlib tells them apart).
//
// read_idx validates everything it can: the magic, the type code, the dimension count, that the
// header is complete, and that the data is exactly as long as the dimensions say. Every problem
// is a lockstep::DataError (lockstep/error.h) naming the file and what is wrong.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "lockstep/error.h"

namespace lockstep::data {

enum class IdxType : std::uint8_t { u8 = 0x08, i8 = 0x09, i16 = 0x0B, i32 = 0x0C, f32 = 0x0D, f64 = 0x0E };

struct IdxArray {
  IdxType type = IdxType::u8;
  std::vector<std::uint32_t> dims;
  std::vector<std::uint8_t> bytes;  // elements as stored (big-endian for multi-byte types)
  std::size_t count() const;        // product of dims
};

IdxArray read_idx(const std::string& path);

}  // namespace lockstep::data
