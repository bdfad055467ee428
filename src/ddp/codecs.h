// The codecs behind ddp/compression.h, for compression.cc's factory and the auto codec.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "lockstep/ddp/compression.h"

namespace lockstep::ddp_detail {

std::shared_ptr<BucketCodec> make_powersgd_codec(std::vector<BucketTensor> layout,
                                                 const CompressionOptions& options);
std::shared_ptr<BucketCodec> make_int8_codec();

// int8 is an all-gather among the holders: from this many machines on it sends more than an exact
// all-reduce would save, and runs exact instead.
inline constexpr int kInt8MaxMachines = 8;

// Bytes a holder sends for an all-reduce of `bytes` among `machines` (a ring: 2 (M - 1) / M of
// it), and for an all-gather of `bytes` from each ((M - 1) blocks).
inline double allreduce_bytes_sent(double bytes, int machines) {
  return machines > 1 ? 2.0 * (machines - 1) / machines * bytes : 0;
}
inline double allgather_bytes_sent(double bytes, int machines) {
  return machines > 1 ? double(machines - 1) * bytes : 0;
}

}  // namespace lockstep::ddp_detail
