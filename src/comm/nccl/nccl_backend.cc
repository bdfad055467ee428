// The nccl backend: collectives on GPU memory through NCCL, one NCCL communicator per lockstep
// Communicator.
//
// Rank 0 makes NCCL's unique id and every rank reads it from the store; each rank uses the GPU
// current on the thread that creates the communicator, else the GPU of its index on its machine
// (LOCAL_RANK's, as torchrun does). Collectives run on a stream of the backend's own, which the
// progress thread polls to completion: NCCL's asynchronous errors and lockstep's watchdog verdicts
// (a peer whose liveness key vanished, a collective past options.timeout) abort the NCCL
// communicator (ncclCommAbort) and fail the collective with PeerError or TimeoutError, as on
// gloo. Host buffers (the Trainer's scalars, a CPU tensor) are staged through device memory, so
// every caller works unchanged; GPU buffers go straight to NCCL. The caller orders its GPU work
// before the call: done when the call is made, or followed by an event it recorded (DeviceReady,
// as the Reducer does), which the backend's stream waits for on the GPU. It finds the result in
// place once the Work is done. What differs from the host backends: NCCL sums f16 and bf16 in their own
// precision, not in f32 rounded once, and has no bitwise reductions (ConfigError).
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "../backend.h"
#include "../liveness.h"
#include "cuda_libraries.h"
#include "lockstep/base/log.h"
#include "lockstep/error.h"
#include "nccl_types.h"

namespace lockstep::comm {
namespace nccl {
namespace {

// Device memory of the backend, grown on demand, for staging host buffers.
class Scratch {
 public:
  explicit Scratch(const CudaDriver& driver) : driver_(driver) {}
  ~Scratch() {
    if (pointer_) driver_.mem_free(pointer_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  CUdeviceptr at_least(std::size_t bytes) {
    if (bytes <= capacity_) return pointer_;
    if (pointer_) driver_.mem_free(pointer_);
    pointer_ = 0;
    capacity_ = 0;
    if (CUresult r = driver_.mem_alloc(&pointer_, bytes); r != CUDA_SUCCESS)
      throw SystemError("nccl: staging " + std::to_string(bytes) + " bytes of host memory on the GPU: " +
                        cuda_error_text(r));
    capacity_ = bytes;
    return pointer_;
  }

 private:
  const CudaDriver& driver_;
  CUdeviceptr pointer_ = 0;
  std::size_t capacity_ = 0;
};

// The bytes a collective reads from send and writes to recv.
struct Extent {
  std::size_t send = 0, recv = 0;
};

Extent extent_of(const Collective& c, int size) {
  const std::size_t bytes = c.count * dtype_size(c.dtype), all = bytes * static_cast<std::size_t>(size);
  switch (c.kind) {
    case CollectiveKind::allreduce: return {bytes, bytes};
    case CollectiveKind::broadcast: return {0, bytes};
    case CollectiveKind::allgather: return {bytes, all};
    case CollectiveKind::reduce_scatter: return {all, bytes};
    case CollectiveKind::barrier: return {0, 0};
  }
  return {};
}

std::string hex(const void* data, std::size_t n) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < n; ++i) {
    const auto b = static_cast<const unsigned char*>(data)[i];
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}

void unhex(const std::string& text, void* data, std::size_t n) {
  if (text.size() != 2 * n) throw PeerError("nccl: the unique id on the store is damaged");
  auto digit = [](char ch) { return ch <= '9' ? ch - '0' : ch - 'a' + 10; };
  for (std::size_t i = 0; i < n; ++i)
    static_cast<unsigned char*>(data)[i] = static_cast<unsigned char>(digit(text[2 * i]) * 16 + digit(text[2 * i + 1]));
}

// The backend's GPU context current on this thread for the scope, and the thread's own after.
class OnDevice {
 public:
  OnDevice(const CudaDriver& driver, CUcontext context) : driver_(driver) { driver_.ctx_push_current(context); }
  ~OnDevice() {
    CUcontext popped = nullptr;
    driver_.ctx_pop_current(&popped);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  const CudaDriver& driver_;
};

class NcclBackend final : public Backend {
 public:
  explicit NcclBackend(const BackendContext& ctx)
      : driver_(cuda_driver()),
        nccl_(nccl_library()),
        store_(ctx.store),
        prefix_(ctx.prefix),
        rank_(ctx.rank),
        size_(ctx.size),
        options_(ctx.options),
        checks_(ctx.options.check_every),
        alive_(ctx) {
    if (!store_) throw ConfigError("nccl: the backend exchanges NCCL's unique id through the store: give it one");
    open_device(choose_device(ctx));
    try {
      OnDevice on(driver_, context_);
      check(driver_.stream_create(&stream_, CU_STREAM_NON_BLOCKING), "creating its stream");
      send_scratch_.emplace(driver_);
      recv_scratch_.emplace(driver_);
      join(exchange_id());
      alive_.announce();
    } catch (...) {
      failed_ = true;
      release();  // no destructor runs for a constructor that threw
      throw;
    }
    LOCKSTEP_LOG(debug, comm) << "nccl: rank " << rank_ << " of " << size_ << " on GPU " << device_;
  }

  ~NcclBackend() override { release(); }

  const std::string& name() const override {
    static const std::string kName = "nccl";
    return kName;
  }
  bool takes_device_memory() const override { return true; }

  // On the progress thread, or on a caller's thread that runs the collective itself (Work::wait):
  // either way with the backend's context current for the call only.
  void run(const Collective& c) override {
    OnDevice on(driver_, context_);
    checks_.before(c, size_, rank_, [&](const std::uint64_t* mine, std::uint64_t* all, std::size_t words) {
      Collective gather = Collective::of(CollectiveKind::allgather, mine, all, words, DType::i64);
      gather.sequence = c.sequence;
      execute(gather);
    });
    execute(c);
  }

  // On the watchdog thread: a peer gone from the store, or the collective past its timeout,
  // becomes the verdict the progress thread aborts with.
  void on_stall(const Collective& c, Seconds running) override {
    if (verdict()) return;
    if (std::string dead = alive_.dead_now(); !dead.empty())
      return set_verdict(std::make_exception_ptr(PeerError("nccl: " + dead + " while rank " + std::to_string(rank_) +
                                                           " was in " + c.describe() + "; the job cannot continue")));
    if (running >= options_.timeout)
      set_verdict(std::make_exception_ptr(TimeoutError("nccl: " + c.describe() + " timed out after " +
                                                       log::seconds_text(options_.timeout.count()) + " on rank " +
                                                       std::to_string(rank_))));
  }

 private:
  // The GPU current on the creating thread, else the rank's index on its machine (LOCAL_RANK's).
  int choose_device(const BackendContext& ctx) {
    CUcontext current = nullptr;
    if (driver_.ctx_get_current(&current) == CUDA_SUCCESS && current) {
      CUdevice device = 0;
      check(driver_.ctx_get_device(&device), "reading the current GPU");
      return device;
    }
    int count = 0;
    check(driver_.device_get_count(&count), "counting GPUs");
    const int local = ctx.locality.local_rank.empty() ? rank_ : ctx.locality.local_rank[static_cast<std::size_t>(rank_)];
    return local % count;
  }

  void open_device(int ordinal) {
    check(driver_.device_get(&device_, ordinal), "opening GPU " + std::to_string(ordinal));
    check(driver_.primary_ctx_retain(&context_, device_), "opening GPU " + std::to_string(ordinal));
  }

  // What the destructor (or a failed constructor) gives back, in order: the NCCL communicator
  // (aborted after a failure: a peer may never reach the end), the staging memory, the stream, the
  // context.
  void release() {
    {
      OnDevice on(driver_, context_);
      if (comm_ && failed_) {
        nccl_.comm_abort(comm_);
      } else if (comm_) {
        nccl_.comm_destroy(comm_);
      }
      comm_ = nullptr;
      send_scratch_.reset();
      recv_scratch_.reset();
      if (stream_) driver_.stream_destroy(stream_);
      stream_ = nullptr;
    }
    driver_.primary_ctx_release(device_);
  }

  ncclUniqueId exchange_id() {
    ncclUniqueId id{};
    const std::string key = prefix_ + "nccl-id";
    if (rank_ == 0) {
      ok(nccl_.get_unique_id(&id), "making the unique id");
      store_->set(key, hex(&id, sizeof id));
    } else {
      unhex(store_->get(key, options_.timeout), &id, sizeof id);
    }
    return id;
  }

  // ncclCommInitRankConfig, non-blocking so that a rank that never joins is a TimeoutError.
  void join(const ncclUniqueId& id) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = nccl_.comm_init_rank_config(&comm_, size_, id, rank_, &config);
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    while (r == ncclInProgress) {
      if (std::chrono::steady_clock::now() > deadline)
        throw TimeoutError("nccl: rank " + std::to_string(rank_) + " waited " +
                           log::seconds_text(options_.timeout.count()) + " for all " + std::to_string(size_) +
                           " ranks to join the NCCL communicator");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      nccl_.comm_get_async_error(comm_, &r);
    }
    ok(r, "joining the communicator");
  }

  // Whether `p` is GPU memory; GPU memory of another GPU than this backend's is a ConfigError.
  bool on_device(const void* p, const Collective& c) const {
    if (!p) return false;
    unsigned type = 0;
    const auto address = reinterpret_cast<CUdeviceptr>(p);
    if (driver_.pointer_get_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address) != CUDA_SUCCESS ||
        type != CU_MEMORYTYPE_DEVICE)
      return false;
    int ordinal = -1;
    if (driver_.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address) == CUDA_SUCCESS &&
        ordinal != device_)
      throw ConfigError("nccl: " + c.describe() + " on rank " + std::to_string(rank_) + " got memory of GPU " +
                        std::to_string(ordinal) + ", but its communicator runs on GPU " + std::to_string(device_) +
                        ": make the worker's GPU current (or set LOCAL_RANK) before creating the communicator");
    return true;
  }

  // One collective, all on the backend's stream: host buffers staged in, NCCL, staged out; then
  // polled to the end.
  void execute(const Collective& c) {
    const Extent bytes = extent_of(c, size_);
    const Reduction reduction = nccl_reduction(c.op, c.dtype);
    const bool host_send = bytes.send && !on_device(c.send, c), host_recv = bytes.recv && !on_device(c.recv, c);
    const void* send = c.send;
    void* recv = c.recv;
    wait_on_gpu_for(c);
    if (host_recv) recv = reinterpret_cast<void*>(recv_scratch_->at_least(bytes.recv));
    if (c.kind == CollectiveKind::broadcast && host_recv) copy_in(recv, c.recv, bytes.recv, c);
    if (c.kind == CollectiveKind::barrier) recv = reinterpret_cast<void*>(recv_scratch_->at_least(8));
    if (host_send && c.send == c.recv && bytes.send == bytes.recv) {  // an in-place allreduce
      send = recv;
      copy_in(recv, c.send, bytes.send, c);
    } else if (host_send) {
      send = reinterpret_cast<void*>(send_scratch_->at_least(bytes.send));
      copy_in(const_cast<void*>(send), c.send, bytes.send, c);
    }
    enqueue(c, send, recv, reduction);
    if (host_recv) copy_out(c.recv, recv, bytes.recv, c);
    wait_for(c);
    if (reduction.divide_after) divide_on_host(c, host_recv ? c.recv : recv);
  }

  // The caller's kernels that write the buffers, ordered before everything on this stream:
  // the GPU waits, not the host.
  void wait_on_gpu_for(const Collective& c) {
    if (!c.ready.event) return;
    if (CUresult r = driver_.stream_wait_event(stream_, static_cast<CUevent>(c.ready.event), 0); r != CUDA_SUCCESS)
      throw SystemError("nccl: " + c.describe() + " could not wait for the caller's event on GPU " +
                        std::to_string(device_) + ": " + cuda_error_text(r));
  }

  void enqueue(const Collective& c, const void* send, void* recv, const Reduction& reduction) {
    const ncclDataType_t type = nccl_type(c.dtype);
    auto stream = reinterpret_cast<cudaStream_t>(stream_);
    ncclResult_t r = ncclSuccess;
    switch (c.kind) {
      case CollectiveKind::allreduce: r = nccl_.all_reduce(send, recv, c.count, type, reduction.op, comm_, stream); break;
      case CollectiveKind::broadcast: r = nccl_.broadcast(recv, recv, c.count, type, c.root, comm_, stream); break;
      case CollectiveKind::allgather: r = nccl_.all_gather(send, recv, c.count, type, comm_, stream); break;
      case CollectiveKind::reduce_scatter:
        r = nccl_.reduce_scatter(send, recv, c.count, type, reduction.op, comm_, stream);
        break;
      case CollectiveKind::barrier: r = nccl_.all_reduce(recv, recv, 1, ncclFloat32, ncclSum, comm_, stream); break;
    }
    if (r != ncclSuccess && r != ncclInProgress) fail(r, c);
  }

  // Polls until NCCL has put the collective on the stream (a non-blocking communicator may still
  // be connecting: ncclInProgress) and the stream has run it, aborting on NCCL's asynchronous
  // error, a failed stream or the watchdog's verdict.
  void wait_for(const Collective& c) {
    for (;;) {
      ncclResult_t async = ncclSuccess;
      nccl_.comm_get_async_error(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) fail(async, c);
      if (auto v = verdict()) {
        abort_communicator();
        std::rethrow_exception(v);
      }
      if (async == ncclSuccess) {
        const CUresult q = driver_.stream_query(stream_);
        if (q == CUDA_SUCCESS) return;
        if (q != CUDA_ERROR_NOT_READY) {
          abort_communicator();
          throw SystemError("nccl: " + c.describe() + " failed on GPU " + std::to_string(device_) + ": " +
                            cuda_error_text(q));
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // avg on integers: summed by NCCL, divided here (truncating, as the other backends do).
  void divide_on_host(const Collective& c, void* result) {
    const std::size_t bytes = extent_of(c, size_).recv;
    if (!on_device(result, c)) return divide_elements(c.dtype, result, c.count, size_);
    std::vector<char> host(bytes);
    copy_out(host.data(), result, bytes, c);
    wait_for(c);
    divide_elements(c.dtype, host.data(), c.count, size_);
    copy_in(result, host.data(), bytes, c);
    wait_for(c);
  }

  // Copies on the backend's stream, so that they are ordered with the collective (the caller's
  // host memory is read or written by the time wait_for returns).
  void copy_in(void* device, const void* host, std::size_t bytes, const Collective& c) {
    if (CUresult r = driver_.memcpy_htod_async(reinterpret_cast<CUdeviceptr>(device), host, bytes, stream_);
        r != CUDA_SUCCESS)
      throw SystemError("nccl: staging " + c.describe() + " onto the GPU: " + cuda_error_text(r));
  }
  void copy_out(void* host, const void* device, std::size_t bytes, const Collective& c) {
    if (CUresult r = driver_.memcpy_dtoh_async(host, reinterpret_cast<CUdeviceptr>(device), bytes, stream_);
        r != CUDA_SUCCESS)
      throw SystemError("nccl: staging " + c.describe() + " back from the GPU: " + cuda_error_text(r));
  }

  // After a failure the NCCL communicator is aborted at once: its kernels would otherwise spin on
  // the GPU, and a device-wide synchronise (a caller's, ZeRO's) would wait for them forever.
  void abort_communicator() {
    failed_ = true;
    if (comm_) nccl_.comm_abort(comm_);
    comm_ = nullptr;
  }

  [[noreturn]] void fail(ncclResult_t r, const Collective& c) {
    const char* last = comm_ ? nccl_.get_last_error(comm_) : nullptr;
    const std::string message = "nccl: " + c.describe() + " failed on rank " + std::to_string(rank_) + ": " +
                                nccl_.get_error_string(r) + (last && *last ? std::string(" (") + last + ")" : "");
    abort_communicator();
    std::rethrow_exception(nccl_error(r, message));
  }
  void ok(ncclResult_t r, const std::string& what) {
    if (r == ncclSuccess) return;
    failed_ = true;
    std::rethrow_exception(nccl_error(r, "nccl: " + what + " failed on rank " + std::to_string(rank_) + ": " +
                                             nccl_.get_error_string(r)));
  }
  void check(CUresult r, const std::string& what) {
    if (r != CUDA_SUCCESS) throw SystemError("nccl: " + what + ": " + cuda_error_text(r));
  }

  std::exception_ptr verdict() {
    std::lock_guard<std::mutex> lock(verdict_mu_);
    return verdict_;
  }
  void set_verdict(std::exception_ptr v) {
    std::lock_guard<std::mutex> lock(verdict_mu_);
    if (!verdict_) verdict_ = std::move(v);
  }

  const CudaDriver& driver_;
  const NcclLibrary& nccl_;
  std::shared_ptr<StoreClient> store_;
  std::string prefix_;
  int rank_, size_;
  CommOptions options_;
  SignatureCheck checks_;
  PeerLiveness alive_;  // the store's verdict on the peers (../liveness.h)
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  CUstream stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  bool failed_ = false;  // abort rather than destroy: a peer may never reach the end
  std::optional<Scratch> send_scratch_, recv_scratch_;
  std::mutex verdict_mu_;
  std::exception_ptr verdict_;
};

}  // namespace
}  // namespace nccl

std::unique_ptr<Backend> make_nccl_backend(const BackendContext& ctx) {
  return std::make_unique<nccl::NcclBackend>(ctx);
}

}  // namespace lockstep::comm
