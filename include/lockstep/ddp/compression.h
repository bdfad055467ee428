// Gradient compression between machines: the codecs DDP's comm hooks "powersgd", "int8" and
// "auto" hand to the communicator (comm/codec.h). Inside a machine the gradients stay exact;
// only what crosses the network is compressed, with error feedback, so what one step loses is
// sent in the next.
//
// PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019). Each matrix-shaped gradient block M
// (rows x cols, the rows a share holds whole) is approximated at rank r: P = M Q summed across
// machines, P orthonormalised, Q = M^T P summed, the estimate P Q^T of the sum. Q carries over to
// the next step (warm start: one power iteration per step tracks the top subspace). Per block,
// (rows + cols) r numbers cross the network instead of rows x cols; vectors (biases, norms),
// embedding tables, rows cut by a share's edge, and matrices too small to gain at least
// `min_compression` are sent exact in the first of the two all-reduces. The first `start_step`
// steps are exact (the estimate needs a subspace to start from, as torch's start_powerSGD_iter).
// Error feedback: each machine keeps what its own sum lost (M minus its part of the estimate) and
// adds it to the next step's gradient. Cost: two small all-reduces and, per block, three
// rows x cols x r matrix products, run on the communication thread: they compete with backward
// for the same cores.
//
// int8: the share with its error added, scaled per 1024 elements to [-127, 127] and rounded;
// the holders all-gather the bytes and every one sums the dequantised values in machine order,
// so all get the same result. A quarter of float32's bytes for two machines; since it is a
// gather, it saves less as machines are added and is not used from 8 machines up (exact then).
//
// auto: exact for `start_step` steps, timing the exact all-reduce of the share; then, with the
// compute of each codec measured on the share itself, the holders agree (one small all-reduce of
// the averaged figures) on the cheapest of exact, int8 and PowerSGD, compressing only when the
// estimate saves at least a fifth of the exact time. Decided once per share and logged on rank 0.
//
// Thread-safety: a codec object serves one bucket; the communicator calls it for one collective
// at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/codec.h"

namespace lockstep {

struct CompressionOptions {
  int powersgd_rank = 4;        // r: columns of P and Q
  int powersgd_rounds = 2;      // 2: P then Q each step (the paper); 2k: k power iterations per step;
                                // 1: alternate sides (PowerGossip)
  int start_step = 10;          // steps all-reduced exactly before compressing (auto: measuring)
  double min_compression = 2;   // PowerSGD compresses a block only if rows x cols >= this x (rows + cols) r
  std::uint64_t seed = 0x5eed;  // Q's initial values: the same on every machine
};

// Where a bucket's tensors sit in it: element offset and shape, in bucket order.
struct BucketTensor {
  std::int64_t offset = 0;
  std::vector<std::int64_t> shape;
  // An embedding table: its gradient is a sum of the rows of the tokens a step saw, one per
  // token, not a product of two thin factors, so a low rank loses much of it. PowerSGD sends it
  // exact (torch's hook compresses it; on the GPT, exact tables took rank 4's validation loss
  // from 4.9% to 4.2% above exact gradients after 300 steps, for 3% of the parameters).
  bool embedding = false;
};

// What a codec chose for a share and why (auto), and what it sent (all codecs).
struct CodecReport {
  std::string choice;              // "exact", "int8", "powersgd" (auto: once decided)
  std::string reason;              // auto: the figures the decision was made on
  std::uint64_t bytes_across = 0;  // bytes sent between machines at the last call
};

// A stateful codec for one bucket of `layout` (float32). `name`: "powersgd", "int8" or "auto".
// `log`, when given, receives each of auto's decisions as one line.
class BucketCodec {
 public:
  virtual ~BucketCodec() = default;
  virtual void operator()(float* share, std::size_t first, std::size_t count, comm::Across& across) = 0;
  virtual CodecReport report() const = 0;
};
std::shared_ptr<BucketCodec> make_bucket_codec(const std::string& name, std::vector<BucketTensor> layout,
                                               const CompressionOptions& options,
                                               std::function<void(const std::string&)> log = nullptr);

// What auto weighs for one share: a codec's measured compute, the bytes it sends, the
// exchanges it makes (each paying the latency), and the time that comes to.
struct CodecEstimate {
  std::string name;
  double compute = 0, bytes = 0;
  int rounds = 1;
  double seconds = 0;
};

// auto's rule: with the exact all-reduce's measured seconds and bytes and the link's latency,
// the link's seconds per byte are (exact - latency) / exact_bytes; each candidate costs
// compute + rounds x latency + bytes x that. The cheapest wins if it saves at least a fifth of
// the exact time, else "exact". Fills in each candidate's seconds.
std::string choose_codec(double exact_seconds, double exact_bytes, double latency,
                         std::vector<CodecEstimate>& candidates);

// The codec as the communicator takes it (shares ownership of the codec object).
comm::Codec as_comm_codec(std::shared_ptr<BucketCodec> codec);

}  // namespace lockstep
