#include "conformance.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>

#include "lockstep/comm/reference.h"

namespace lockstep::testing {
namespace {

using namespace lockstep::comm;

double value(int rank, std::size_t i) {
  return reference::input(rank, i);
}

struct Buffer {
  DType t;
  std::vector<char> bytes;
  Buffer(DType type, std::size_t n) : t(type), bytes(n * dtype_size(type) + 1) {}
  void* data() { return bytes.data(); }
  void set(std::size_t i, double v) { store_element(t, data(), i, v); }
  double get(std::size_t i) { return load_element(t, data(), i); }
};

double expected(ReduceOp op, DType t, int world, std::size_t i) {
  return reference::reduced(op, t, world, i);
}

// A product rounds once per multiplication where the others round about once: up to world - 1
// roundings of the type's unit (Gloo's ring rounds 16-bit types at every hop).
double tolerance_of(ReduceOp op, DType t, int world, double want) {
  const double once = reference::tolerance(t, want);
  return op == ReduceOp::product ? once * world : once;
}

// The inputs are integers in [-4, 8]: a product of more than 5 can pass f16's largest finite
// value (65504) part-way, and inf times a later 0 is NaN, so f16 products are checked up to 5 ranks.
bool checked(ReduceOp op, DType t, int world) {
  if (!is_valid_reduction(op, t)) return false;
  return !(op == ReduceOp::product && t == DType::f16 && world > 5);
}

class Checker {
 public:
  explicit Checker(std::vector<std::string>& failures) : failures_(failures) {}
  void expect(const std::string& what, std::size_t i, double got, double want, double tol) {
    if (std::abs(got - want) <= tol || reported_ > 50) return;
    std::ostringstream s;
    s << what << ": element " << i << " is " << got << ", want " << want;
    failures_.push_back(s.str());
    ++reported_;
  }

 private:
  std::vector<std::string>& failures_;
  int reported_ = 0;
};

}  // namespace

std::vector<std::string> run_conformance(Communicator& comm, const std::vector<std::size_t>& counts) {
  std::vector<std::string> failures;
  Checker check(failures);
  const int rank = comm.rank(), world = comm.size();
  for (std::size_t n : counts) {
    for (DType t : kAllDTypes) {
      auto label = [&](const std::string& what) {
        return what + " " + dtype_name(t) + " count=" + std::to_string(n) +
               " world=" + std::to_string(world) + " rank=" + std::to_string(rank);
      };
      // Shared memory, where the backend has it: the in-place allreduce reads peers' buffers
      // directly. One element in, so the data does not start at the buffer's start.
      std::shared_ptr<void> shared;
      if (n > 0) shared = comm.allocate_shared((n + 1) * dtype_size(t));
      if (n > 0 && world > 1 && comm.backend_name() == "shm" && !shared)
        failures.push_back(label("allocate_shared") + ": nullptr on the shm backend");
      for (ReduceOp op : kAllReduceOps) {
        if (!checked(op, t, world)) continue;
        if (shared) {
          void* at = static_cast<char*>(shared.get()) + dtype_size(t);
          for (std::size_t i = 0; i < n; ++i) store_element(t, at, i, value(rank, i));
          comm.allreduce(at, n, t, op)->wait();
          for (std::size_t i = 0; i < n; ++i) {
            double want = expected(op, t, world, i);
            check.expect(label(std::string("allreduce shared ") + reduce_op_name(op)), i,
                         load_element(t, at, i), want, tolerance_of(op, t, world, want));
          }
        }
        // allreduce, out of place and in place
        Buffer in(t, n), out(t, n), inplace(t, n);
        for (std::size_t i = 0; i < n; ++i) in.set(i, value(rank, i)), inplace.set(i, value(rank, i));
        comm.allreduce(in.data(), out.data(), n, t, op)->wait();
        comm.allreduce(inplace.data(), n, t, op)->wait();
        for (std::size_t i = 0; i < n; ++i) {
          double want = expected(op, t, world, i);
          check.expect(label(std::string("allreduce ") + reduce_op_name(op)), i, out.get(i), want,
                       tolerance_of(op, t, world, want));
          check.expect(label(std::string("allreduce in-place ") + reduce_op_name(op)), i, inplace.get(i),
                       want, tolerance_of(op, t, world, want));
        }
        // the input of an out-of-place allreduce is left alone
        for (std::size_t i = 0; i < n; ++i)
          check.expect(label("allreduce input kept"), i, in.get(i), value(rank, i), 0);

        // reduce_scatter: block r of the input is element r*n + i; value() of the global index
        Buffer rs_in(t, n * static_cast<std::size_t>(world)), rs_out(t, n);
        for (std::size_t i = 0; i < n * static_cast<std::size_t>(world); ++i) rs_in.set(i, value(rank, i));
        comm.reduce_scatter(rs_in.data(), rs_out.data(), n, t, op)->wait();
        for (std::size_t i = 0; i < n; ++i) {
          double want = expected(op, t, world, static_cast<std::size_t>(rank) * n + i);
          check.expect(label(std::string("reduce_scatter ") + reduce_op_name(op)), i, rs_out.get(i), want,
                       tolerance_of(op, t, world, want));
        }
      }
      // broadcast from every root
      for (int root = 0; root < world; ++root) {
        Buffer b(t, n);
        for (std::size_t i = 0; i < n; ++i) b.set(i, rank == root ? value(root, i) : 99);
        comm.broadcast(b.data(), n, t, root)->wait();
        for (std::size_t i = 0; i < n; ++i)
          check.expect(label("broadcast root=" + std::to_string(root)), i, b.get(i), value(root, i), 0);
      }
      // allgather, out of place and in place (own block already at its offset)
      Buffer g_in(t, n), g_out(t, n * static_cast<std::size_t>(world)),
          g_inplace(t, n * static_cast<std::size_t>(world));
      for (std::size_t i = 0; i < n; ++i) g_in.set(i, value(rank, i));
      for (std::size_t i = 0; i < n; ++i)
        g_inplace.set(static_cast<std::size_t>(rank) * n + i, value(rank, i));
      comm.allgather(g_in.data(), g_out.data(), n, t)->wait();
      comm.allgather(
              static_cast<char*>(g_inplace.data()) + static_cast<std::size_t>(rank) * n * dtype_size(t),
              g_inplace.data(), n, t)
          ->wait();
      for (int r = 0; r < world; ++r)
        for (std::size_t i = 0; i < n; ++i) {
          std::size_t at = static_cast<std::size_t>(r) * n + i;
          check.expect(label("allgather block " + std::to_string(r)), i, g_out.get(at), value(r, i), 0);
          check.expect(label("allgather in-place block " + std::to_string(r)), i, g_inplace.get(at),
                       value(r, i), 0);
        }
    }
  }
  comm.barrier()->wait();
  return failures;
}

}  // namespace lockstep::testing
