// ProcessGroupLockstep: the collectives that move blocks between ranks — all_gather (list and
// tensor forms, coalesced), gather, scatter, reduce_scatter (list and tensor forms) and
// all-to-all — built on lockstep's allgather, reduce_scatter and broadcast.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "process_group.h"
#include "tensor_wire.h"

namespace lockstep::torch_backend {
namespace {

std::string describe(const at::Tensor& t) {
  return std::to_string(t.numel()) + " elements of " + std::string(c10::toString(t.scalar_type()));
}

// Every block of a gather must look like the tensor this rank contributes.
void check_like(const at::Tensor& block, const at::Tensor& reference, const char* collective, const char* which) {
  check_cpu_dense(block, collective);
  if (block.scalar_type() != reference.scalar_type() || block.numel() != reference.numel())
    throw std::runtime_error(std::string("lockstep: ") + collective + ": " + which + " holds " + describe(block) +
                             " but the rank's own tensor " + describe(reference) + "; they must match");
}

void check_list(const std::vector<at::Tensor>& list, std::size_t size, const at::Tensor& reference,
                const char* collective, const char* which) {
  if (list.size() != size)
    throw std::runtime_error(std::string("lockstep: ") + collective + " needs one " + which + " per rank (" +
                             std::to_string(size) + "), got " + std::to_string(list.size()));
  for (const auto& t : list) check_like(t, reference, collective, which);
}

void require_one_list(std::size_t lists, const char* collective) {
  if (lists != 1)
    throw std::runtime_error(std::string("lockstep: ") + collective + " takes one tensor list per call, got " +
                             std::to_string(lists) + " (the *_multigpu forms are not supported)");
}

// Unpacks `blocks` consecutive wire blocks into `output`, read as that many equal pieces.
void unpack_blocks(const at::Tensor& wire, const WireSpec& spec, std::int64_t blocks, const at::Tensor& output) {
  const at::Tensor target = output.is_contiguous() ? output : at::empty(output.sizes(), output.options());
  const at::Tensor flat = target.reshape({-1});
  const std::int64_t n = blocks == 0 ? 0 : flat.numel() / blocks;
  for (std::int64_t r = 0; r < blocks; ++r) unpack(wire_block(wire, spec, r), spec, flat.narrow(0, r * n, n));
  if (!output.is_contiguous()) output.copy_(target);
}

std::size_t count_of(const WireSpec& spec) {
  return static_cast<std::size_t>(spec.count);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& /*opts*/) {
  const at::Tensor in = single(inputs, "all_gather");
  check_cpu_dense(in, "all_gather");
  require_one_list(outputs.size(), "all_gather");
  const std::vector<at::Tensor> outs = outputs[0];
  check_list(outs, static_cast<std::size_t>(size_), in, "all_gather", "output tensor");
  return gather_blocks(c10d::OpType::ALLGATHER, in, outs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::gather_blocks(c10d::OpType type, const at::Tensor& in,
                                                                   std::vector<at::Tensor> outs) {
  const WireSpec spec = move_spec(in);
  const Wire send = wire_of(in, spec);
  const at::Tensor gathered = empty_wire(spec, size_);
  return launch(
      type,
      [&](comm::Communicator& c) {
        return one(c.allgather(send.buffer.data_ptr(), gathered.data_ptr(), count_of(spec), spec.dtype));
      },
      [send, gathered, spec, outs] {
        for (std::size_t r = 0; r < outs.size(); ++r)
          unpack(wire_block(gathered, spec, static_cast<std::int64_t>(r)), spec, outs[r]);
      },
      outs, {in});
}

// all_gather_into_tensor: straight into the output when it is contiguous and of a type comm
// moves as it is (the input may sit inside it, at this rank's offset).
c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::AllgatherOptions& /*opts*/) {
  const char* name = "all_gather_into_tensor";
  check_cpu_dense(input, name);
  check_cpu_dense(output, name);
  if (output.scalar_type() != input.scalar_type() || output.numel() != size_ * input.numel())
    throw std::runtime_error(std::string("lockstep: ") + name + ": the output holds " + describe(output) +
                             ", it must hold world size (" + std::to_string(size_) + ") times the input's " +
                             describe(input));
  const WireSpec spec = move_spec(input);
  const Wire send = wire_of(input, spec);
  const at::Tensor direct = spec.kind == WireKind::native ? wire_view(output, move_spec(output)) : at::Tensor();
  const at::Tensor gathered = direct.defined() ? direct : empty_wire(spec, size_);
  const at::Tensor out = output;
  const std::int64_t blocks = size_;
  return launch(
      c10d::OpType::_ALLGATHER_BASE,
      [&](comm::Communicator& c) {
        return one(c.allgather(send.buffer.data_ptr(), gathered.data_ptr(), count_of(spec), spec.dtype));
      },
      [send, gathered, spec, out, blocks, copied = !direct.defined()] {
        if (copied) unpack_blocks(gathered, spec, blocks, out);
      },
      {output});
}

// Each rank's tensors travel as one block of bytes, so they may differ in dtype.
c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  const char* name = "all_gather_coalesced";
  if (outputs.size() != static_cast<std::size_t>(size_))
    throw std::runtime_error(std::string("lockstep: ") + name + " needs one output list per rank (" +
                             std::to_string(size_) + "), got " + std::to_string(outputs.size()));
  std::vector<WireSpec> specs;
  std::vector<std::int64_t> offsets;
  std::int64_t words = 0;
  for (const auto& t : inputs) {
    check_cpu_dense(t, name);
    specs.push_back(bytes_spec(t));
    offsets.push_back(words);
    words += specs.back().count;
  }
  for (const auto& list : outputs) {
    if (list.size() != inputs.size())
      throw std::runtime_error(std::string("lockstep: ") + name + ": every output list must hold " +
                               std::to_string(inputs.size()) + " tensors, like the input list");
    for (std::size_t i = 0; i < list.size(); ++i) check_like(list[i], inputs[i], name, "an output tensor");
  }
  const at::Tensor send = at::zeros({words}, at::kInt);
  for (std::size_t i = 0; i < inputs.size(); ++i) pack(inputs[i], specs[i], send.narrow(0, offsets[i], specs[i].count));
  const at::Tensor gathered = at::empty({words * size_}, at::kInt);
  std::vector<at::Tensor> flat_outputs;
  for (const auto& list : outputs) flat_outputs.insert(flat_outputs.end(), list.begin(), list.end());
  const auto outs = outputs;
  return launch(
      c10d::OpType::ALLGATHER_COALESCED,
      [&](comm::Communicator& c) {
        return one(c.allgather(send.data_ptr(), gathered.data_ptr(), static_cast<std::size_t>(words), comm::DType::i32));
      },
      [send, gathered, specs, offsets, words, outs] {
        for (std::size_t r = 0; r < outs.size(); ++r)
          for (std::size_t i = 0; i < outs[r].size(); ++i)
            unpack(gathered.narrow(0, static_cast<std::int64_t>(r) * words + offsets[i], specs[i].count), specs[i],
                   outs[r][i]);
      },
      flat_outputs, inputs);
}

// An allgather whose blocks only the root unpacks.
c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::GatherOptions& opts) {
  const at::Tensor in = single(inputs, "gather");
  check_cpu_dense(in, "gather");
  check_root(opts.rootRank, "gather");
  const bool root = opts.rootRank == rank_;
  std::vector<at::Tensor> outs;
  if (root) {
    require_one_list(outputs.size(), "gather");
    outs = outputs[0];
    check_list(outs, static_cast<std::size_t>(size_), in, "gather", "gather_list tensor");
  }
  return gather_blocks(c10d::OpType::GATHER, in, outs);  // every rank gathers; non-roots keep nothing
}

// A broadcast of all the root's blocks; each rank keeps its own.
c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::scatter(std::vector<at::Tensor>& outputs,
                                                             std::vector<std::vector<at::Tensor>>& inputs,
                                                             const c10d::ScatterOptions& opts) {
  const at::Tensor out = single(outputs, "scatter");
  check_cpu_dense(out, "scatter");
  check_root(opts.rootRank, "scatter");
  const bool root = opts.rootRank == rank_;
  const WireSpec spec = move_spec(out);
  const at::Tensor blocks = empty_wire(spec, size_);
  if (root) {
    require_one_list(inputs.size(), "scatter");
    check_list(inputs[0], static_cast<std::size_t>(size_), out, "scatter", "scatter_list tensor");
    for (int r = 0; r < size_; ++r) pack(inputs[0][static_cast<std::size_t>(r)], spec, wire_block(blocks, spec, r));
  }
  const int from = static_cast<int>(opts.rootRank);
  const std::int64_t mine = rank_;
  return launch(
      c10d::OpType::SCATTER,
      [&](comm::Communicator& c) {
        return one(c.broadcast(blocks.data_ptr(), count_of(spec) * static_cast<std::size_t>(size_), spec.dtype, from));
      },
      [blocks, spec, out, mine] { unpack(wire_block(blocks, spec, mine), spec, out); }, {out});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                                    const c10d::ReduceScatterOptions& opts) {
  const at::Tensor out = single(outputs, "reduce_scatter");
  const WireSpec spec = reduce_spec(out, opts.reduceOp, "reduce_scatter");
  const comm::ReduceOp op = comm_op(opts.reduceOp, "reduce_scatter");
  require_one_list(inputs.size(), "reduce_scatter");
  check_list(inputs[0], static_cast<std::size_t>(size_), out, "reduce_scatter", "input tensor");
  const at::Tensor send = empty_wire(spec, size_);
  for (int r = 0; r < size_; ++r) pack(inputs[0][static_cast<std::size_t>(r)], spec, wire_block(send, spec, r));
  const Wire receive = wire_of(out, spec, /*fill=*/false);
  return launch(
      c10d::OpType::REDUCE_SCATTER,
      [&](comm::Communicator& c) {
        return one(c.reduce_scatter(send.data_ptr(), receive.buffer.data_ptr(), count_of(spec), spec.dtype, op));
      },
      [send, receive, spec, out] {
        if (receive.copied) unpack(receive.buffer, spec, out);
      },
      {out});
}

// reduce_scatter_tensor: without copies when both tensors are contiguous and of a type comm
// reduces as it is.
c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                          const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor";
  const WireSpec out_spec = reduce_spec(output, opts.reduceOp, name);
  const WireSpec in_spec = reduce_spec(input, opts.reduceOp, name);
  const comm::ReduceOp op = comm_op(opts.reduceOp, name);
  if (output.scalar_type() != input.scalar_type() || input.numel() != size_ * output.numel())
    throw std::runtime_error(std::string("lockstep: ") + name + ": the input holds " + describe(input) +
                             ", it must hold world size (" + std::to_string(size_) + ") times the output's " +
                             describe(output));
  const Wire send = wire_of(input, in_spec);
  const Wire receive = wire_of(output, out_spec, /*fill=*/false);
  const at::Tensor out = output;
  return launch(
      c10d::OpType::_REDUCE_SCATTER_BASE,
      [&](comm::Communicator& c) {
        return one(
            c.reduce_scatter(send.buffer.data_ptr(), receive.buffer.data_ptr(), count_of(out_spec), out_spec.dtype, op));
      },
      [send, receive, out_spec, out] {
        if (receive.copied) unpack(receive.buffer, out_spec, out);
      },
      {output});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                   std::vector<int64_t>& output_split_sizes,
                                                                   std::vector<int64_t>& input_split_sizes,
                                                                   const c10d::AllToAllOptions& /*opts*/) {
  const char* name = "all_to_all_single";
  check_cpu_dense(input, name);
  check_cpu_dense(output, name);
  if (input.scalar_type() != output.scalar_type())
    throw std::runtime_error(std::string("lockstep: ") + name + ": input and output dtypes differ (" +
                             describe(input) + ", " + describe(output) + ")");
  // Splits along dim 0; none given: equal ones (torch checks the sizes divide).
  auto pieces = [&](const at::Tensor& t, const std::vector<int64_t>& splits) {
    std::vector<at::Tensor> out;
    std::int64_t at_row = 0;
    for (int r = 0; r < size_; ++r) {
      const std::int64_t rows =
          splits.empty() ? (t.dim() == 0 ? 0 : t.size(0) / size_) : splits[static_cast<std::size_t>(r)];
      out.push_back(t.narrow(0, at_row, rows));
      at_row += rows;
    }
    return out;
  };
  if ((!input_split_sizes.empty() && input_split_sizes.size() != static_cast<std::size_t>(size_)) ||
      (!output_split_sizes.empty() && output_split_sizes.size() != static_cast<std::size_t>(size_)))
    throw std::runtime_error(std::string("lockstep: ") + name + " needs one split size per rank (" +
                             std::to_string(size_) + ")");
  return exchange_blocks(pieces(input, input_split_sizes), pieces(output, output_split_sizes), {output});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& /*opts*/) {
  if (inputs.size() != static_cast<std::size_t>(size_) || outputs.size() != static_cast<std::size_t>(size_))
    throw std::runtime_error("lockstep: all_to_all needs one input and one output tensor per rank (" +
                             std::to_string(size_) + ")");
  for (std::size_t r = 0; r < inputs.size(); ++r) {
    check_cpu_dense(inputs[r], "all_to_all");
    check_cpu_dense(outputs[r], "all_to_all");
  }
  return exchange_blocks(inputs, outputs, outputs);
}

// All-to-all through one allgather: every rank contributes its blocks, one per destination,
// each padded to the largest block any rank sends (one small allreduce finds it, waited here),
// and keeps the blocks addressed to it. Blocks travel as bytes, so any dtype works.
c10::intrusive_ptr<c10d::Work> ProcessGroupLockstep::exchange_blocks(const std::vector<at::Tensor>& send,
                                                                     const std::vector<at::Tensor>& receive,
                                                                     std::vector<at::Tensor> outputs) {
  std::int64_t largest = 0;
  for (const auto& block : send) largest = std::max(largest, bytes_spec(block).count);
  comm::WorkPtr agree;
  {
    std::lock_guard<std::mutex> lock(issue_mu_);
    agree = comm_->allreduce(&largest, 1, comm::DType::i64, comm::ReduceOp::max);
  }
  agree->wait();
  const std::int64_t words = largest, world = size_, mine = rank_;
  const at::Tensor packed = at::zeros({world * words}, at::kInt);
  for (std::int64_t r = 0; r < world; ++r) {
    const at::Tensor& block = send[static_cast<std::size_t>(r)];
    const WireSpec spec = bytes_spec(block);
    pack(block, spec, packed.narrow(0, r * words, spec.count));
  }
  const at::Tensor gathered = at::empty({world * world * words}, at::kInt);
  return launch(
      c10d::OpType::ALLTOALL,
      [&](comm::Communicator& c) {
        return one(c.allgather(packed.data_ptr(), gathered.data_ptr(), static_cast<std::size_t>(world * words),
                               comm::DType::i32));
      },
      [packed, gathered, receive, words, world, mine] {
        for (std::int64_t from = 0; from < world; ++from) {
          const at::Tensor& block = receive[static_cast<std::size_t>(from)];
          const WireSpec spec = bytes_spec(block);
          if (spec.count > words)
            throw std::runtime_error("lockstep: all_to_all: rank " + std::to_string(from) + " sent fewer elements "
                                     "than this rank's output split for it expects");
          unpack(gathered.narrow(0, (from * world + mine) * words, spec.count), spec, block);
        }
      },
      std::move(outputs));
}

}  // namespace lockstep::torch_backend
