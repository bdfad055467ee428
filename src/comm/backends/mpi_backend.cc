// The mpi backend: collectives through Open MPI, for jobs started by mpirun/srun.
//
// Each lockstep Communicator owns a duplicate of MPI_COMM_WORLD, so its messages never mix with
// the program's own MPI traffic. MPI is initialised on first use with MPI_THREAD_SERIALIZED (the
// progress thread makes every call) and finalised at process exit. Errors return (not abort) and
// become PeerError. Limits, stated plainly: MPI has no per-call deadline, so options.timeout is
// not enforced here; a dead peer is handled by mpirun, which by default kills the whole job.
// It also serves as the hier backend's engine between machines (LOCKSTEP_HIER_ACROSS=mpi): one
// MPI communicator per local index, split from MPI_COMM_WORLD (make_mpi_group_backend).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "backend.h"
#include "lockstep/error.h"

namespace lockstep::comm {
namespace {

void ensure_mpi_initialised() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (initialised) return;
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (provided < MPI_THREAD_SERIALIZED)
      throw ConfigError("mpi: this MPI library does not support MPI_THREAD_SERIALIZED");
    std::atexit([] {
      int finalised = 0;
      MPI_Finalized(&finalised);
      if (!finalised) MPI_Finalize();
    });
  });
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    default: return MPI_FLOAT;  // half types are widened to f32 first
  }
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::min: return MPI_MIN;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::product: return MPI_PROD;
    case ReduceOp::band: return MPI_BAND;
    case ReduceOp::bor: return MPI_BOR;
    case ReduceOp::bxor: return MPI_BXOR;
    default: return MPI_SUM;
  }
}

int as_int(std::size_t n, const Collective& c) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw ConfigError("mpi: " + c.describe() + " exceeds MPI's int count; split it");
  return static_cast<int>(n);
}

class MpiBackend final : public Backend {
 public:
  explicit MpiBackend(const BackendContext& ctx)
      : rank_(ctx.rank), size_(ctx.size), options_(ctx.options), checks_(ctx.options.check_every) {
    ensure_mpi_initialised();
    int world_rank = 0, world_size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    if (world_rank != rank_ || world_size != size_)
      throw ConfigError("mpi: MPI says rank " + std::to_string(world_rank) + " of " +
                        std::to_string(world_size) + " but lockstep was told rank " + std::to_string(rank_) +
                        " of " + std::to_string(size_) + ": under mpirun leave RANK/WORLD_SIZE unset");
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  }

  // Over `group`, already split from MPI_COMM_WORLD, whose ranks are ctx's.
  MpiBackend(const BackendContext& ctx, MPI_Comm group)
      : rank_(ctx.rank), size_(ctx.size), options_(ctx.options), checks_(ctx.options.check_every), comm_(group) {
    int rank = 0, size = 0;
    MPI_Comm_rank(comm_, &rank);
    MPI_Comm_size(comm_, &size);
    if (rank != rank_ || size != size_)
      throw ConfigError("mpi: the group split from MPI's ranks is rank " + std::to_string(rank) + " of " +
                        std::to_string(size) + ", not " + std::to_string(rank_) + " of " + std::to_string(size_));
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  }

  ~MpiBackend() override {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (!finalised) MPI_Comm_free(&comm_);
  }

  const std::string& name() const override {
    static const std::string kName = "mpi";
    return kName;
  }

  void run(const Collective& c) override {
    checks_.before(c, size_, rank_, [&](const std::uint64_t* mine, std::uint64_t* all, std::size_t words) {
      ok(MPI_Allgather(mine, as_int(words, c), MPI_UINT64_T, all, as_int(words, c), MPI_UINT64_T, comm_), c);
    });
    const std::size_t esize = dtype_size(c.dtype);
    switch (c.kind) {
      case CollectiveKind::barrier: return ok(MPI_Barrier(comm_), c);
      case CollectiveKind::broadcast:
        return ok(MPI_Bcast(c.recv, as_int(c.count * esize, c), MPI_BYTE, c.root, comm_), c);
      case CollectiveKind::allgather: {
        int n = as_int(c.count * esize, c);
        const void* in = c.send == static_cast<char*>(c.recv) + static_cast<std::size_t>(rank_) * n
                             ? MPI_IN_PLACE
                             : c.send;
        return ok(MPI_Allgather(in, n, MPI_BYTE, c.recv, n, MPI_BYTE, comm_), c);
      }
      case CollectiveKind::allreduce:
      case CollectiveKind::reduce_scatter: return reduce(c);
    }
  }

 private:
  void ok(int code, const Collective& c) {
    if (code == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(code, text, &len);
    throw PeerError("mpi: " + c.describe() + " failed on rank " + std::to_string(rank_) + ": " +
                    std::string(text, static_cast<std::size_t>(len)));
  }

  void reduce(const Collective& c) {
    bool all = c.kind == CollectiveKind::allreduce;
    std::size_t in_count = all ? c.count : c.count * static_cast<std::size_t>(size_);
    bool half = c.dtype == DType::f16 || c.dtype == DType::bf16;
    std::vector<float> wide_in, wide_out;
    const void* in = c.send;
    void* out = c.recv;
    if (half) {
      auto* src = static_cast<const std::uint16_t*>(c.send);
      wide_in.resize(in_count);
      for (std::size_t i = 0; i < in_count; ++i)
        wide_in[i] = c.dtype == DType::f16 ? f16_to_f32(src[i]) : bf16_to_f32(src[i]);
      wide_out.resize(c.count);
      in = wide_in.data();
      out = wide_out.data();
    }
    int n = as_int(c.count, c);
    if (all)
      ok(MPI_Allreduce(in == out ? MPI_IN_PLACE : in, out, n, mpi_type(c.dtype), mpi_op(c.op), comm_), c);
    else
      ok(MPI_Reduce_scatter_block(in, out, n, mpi_type(c.dtype), mpi_op(c.op), comm_), c);
    if (c.op == ReduceOp::avg) divide_elements(half ? DType::f32 : c.dtype, out, c.count, size_);
    if (half) {
      auto* dst = static_cast<std::uint16_t*>(c.recv);
      for (std::size_t i = 0; i < c.count; ++i)
        dst[i] = c.dtype == DType::f16 ? f32_to_f16(wide_out[i]) : f32_to_bf16(wide_out[i]);
    }
  }

  int rank_, size_;
  CommOptions options_;
  SignatureCheck checks_;
  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace

std::unique_ptr<Backend> make_mpi_backend(const BackendContext& ctx) {
  return std::make_unique<MpiBackend>(ctx);
}

std::unique_ptr<Backend> make_mpi_group_backend(const BackendContext& ctx, int color) {
  ensure_mpi_initialised();
  MPI_Comm group = MPI_COMM_NULL;
  if (MPI_Comm_split(MPI_COMM_WORLD, color >= 0 ? color : MPI_UNDEFINED, ctx.rank, &group) != MPI_SUCCESS)
    throw PeerError("mpi: splitting MPI's ranks into the hier backend's groups failed");
  if (group == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiBackend>(ctx, group);
}

std::vector<std::string> mpi_allgather_text(const std::string& mine) {
  constexpr int kRecord = 256;  // a length byte, then the text
  if (mine.size() >= kRecord) throw ConfigError("mpi: '" + mine + "' is too long to exchange");
  ensure_mpi_initialised();
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<char> record(kRecord, 0), all(static_cast<std::size_t>(kRecord) * static_cast<std::size_t>(size));
  record[0] = static_cast<char>(mine.size());
  std::memcpy(record.data() + 1, mine.data(), mine.size());
  if (MPI_Allgather(record.data(), kRecord, MPI_CHAR, all.data(), kRecord, MPI_CHAR, MPI_COMM_WORLD) != MPI_SUCCESS)
    throw PeerError("mpi: the allgather of the point-to-point addresses failed");
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) {
    const char* p = all.data() + static_cast<std::size_t>(r) * kRecord;
    out.emplace_back(p + 1, static_cast<std::size_t>(static_cast<unsigned char>(p[0])));
  }
  return out;
}

}  // namespace lockstep::comm
