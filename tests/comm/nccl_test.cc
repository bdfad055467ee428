// The nccl backend: its mapping of lockstep's types, reductions and errors to NCCL's (pure, run
// everywhere), and a communicator on it: on a machine without a GPU (or its driver) a ConfigError
// that says why and names the backends to use instead; with one (scripts/gpu-check), a world of
// one all-reduces GPU memory and host memory (staged) alike, and orders a collective after the
// caller's event on the GPU.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/error.h"
#include "nccl/cuda_libraries.h"
#include "nccl/nccl_types.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::comm;

namespace {

// Whether this machine can run NCCL at all (driver, GPU, library), and if not why.
std::string why_no_nccl() {
  try {
    nccl::cuda_driver();
    nccl::nccl_library();
    return "";
  } catch (const ConfigError& e) {
    return e.what();
  }
}

// GPU 0's primary context (the one the CUDA runtime and PyTorch use), current in this thread
// while it lives: the driver API allocates in the calling thread's current context, and a
// thread has none until it is given one.
class OnGpu0 {
 public:
  explicit OnGpu0(const nccl::CudaDriver& cuda) : cuda_(cuda) {
    EXPECT_EQ(cuda_.device_get(&device_, 0), CUDA_SUCCESS);
    EXPECT_EQ(cuda_.primary_ctx_retain(&context_, device_), CUDA_SUCCESS);
    EXPECT_EQ(cuda_.ctx_set_current(context_), CUDA_SUCCESS);
  }
  ~OnGpu0() {
    cuda_.ctx_set_current(nullptr);
    cuda_.primary_ctx_release(device_);
  }
  OnGpu0(const OnGpu0&) = delete;
  OnGpu0& operator=(const OnGpu0&) = delete;

 private:
  const nccl::CudaDriver& cuda_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
};

// What the ordering test needs beyond the backend's table, from the same driver: events, pinned
// memory the GPU maps, and a stream that waits for a value in it.
struct StreamTools {
  decltype(&::cuEventCreate) event_create = nullptr;
  decltype(&::cuEventRecord) event_record = nullptr;
  decltype(&::cuEventDestroy) event_destroy = nullptr;
  decltype(&::cuMemHostAlloc) host_alloc = nullptr;
  decltype(&::cuMemHostGetDevicePointer) host_device_pointer = nullptr;
  decltype(&::cuMemFreeHost) free_host = nullptr;
  decltype(&::cuStreamWaitValue32) wait_value = nullptr;
  decltype(&::cuStreamSynchronize) synchronize = nullptr;

  static StreamTools load() {
    StreamTools t;
    void* h = ::dlopen("libcuda.so.1", RTLD_NOW);
    auto get = [h](auto& f, const char* name) { f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(::dlsym(h, name)); };
    if (!h) return t;
    get(t.event_create, "cuEventCreate");
    get(t.event_record, "cuEventRecord");
    get(t.event_destroy, "cuEventDestroy_v2");
    get(t.host_alloc, "cuMemHostAlloc");
    get(t.host_device_pointer, "cuMemHostGetDevicePointer_v2");
    get(t.free_host, "cuMemFreeHost");
    get(t.wait_value, "cuStreamWaitValue32_v2");
    get(t.synchronize, "cuStreamSynchronize");
    return t;
  }
  bool complete() const {
    return event_create && event_record && event_destroy && host_alloc && host_device_pointer && free_host &&
           wait_value && synchronize;
  }
};

}  // namespace

TEST(NcclTypes, EveryElementTypeHasItsOwnNcclType) {
  std::set<int> seen;
  for (DType t : kAllDTypes) seen.insert(static_cast<int>(nccl::nccl_type(t)));
  EXPECT_EQ(seen.size(), std::size(kAllDTypes));
  EXPECT_EQ(nccl::nccl_type(DType::bf16), ncclBfloat16);
  EXPECT_EQ(nccl::nccl_type(DType::i64), ncclInt64);
}

TEST(NcclTypes, AvgOnIntegersIsASumDividedAfterAndBitwiseReductionsAreRefused) {
  EXPECT_EQ(nccl::nccl_reduction(ReduceOp::avg, DType::f32).op, ncclAvg);
  EXPECT_FALSE(nccl::nccl_reduction(ReduceOp::avg, DType::bf16).divide_after);
  const auto integer_avg = nccl::nccl_reduction(ReduceOp::avg, DType::i32);
  EXPECT_EQ(integer_avg.op, ncclSum);
  EXPECT_TRUE(integer_avg.divide_after);
  EXPECT_EQ(nccl::nccl_reduction(ReduceOp::product, DType::f64).op, ncclProd);
  for (ReduceOp op : {ReduceOp::band, ReduceOp::bor, ReduceOp::bxor}) {
    try {
      nccl::nccl_reduction(op, DType::i64);
      ADD_FAILURE() << reduce_op_name(op) << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(reduce_op_name(op)), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("another backend"), std::string::npos) << e.what();  // what to use instead
    }
  }
}

TEST(NcclTypes, APeersFailureIsAPeerErrorAndMisuseAConfigError) {
  EXPECT_THROW(std::rethrow_exception(nccl::nccl_error(ncclRemoteError, "x")), PeerError);
  EXPECT_THROW(std::rethrow_exception(nccl::nccl_error(ncclSystemError, "x")), PeerError);
  EXPECT_THROW(std::rethrow_exception(nccl::nccl_error(ncclInvalidUsage, "x")), ConfigError);
  EXPECT_THROW(std::rethrow_exception(nccl::nccl_error(ncclInvalidArgument, "x")), ConfigError);
  EXPECT_THROW(std::rethrow_exception(nccl::nccl_error(ncclUnhandledCudaError, "x")), SystemError);
  try {
    std::rethrow_exception(nccl::nccl_error(ncclRemoteError, "nccl: allreduce #3 failed"));
  } catch (const PeerError& e) {
    EXPECT_STREQ(e.what(), "nccl: allreduce #3 failed");
  }
}

TEST(Nccl, AWorldOfOneReducesGpuAndHostMemoryOrSaysWhyNot) {
  CommOptions options;
  options.backend = "nccl";
  const std::string why = why_no_nccl();
  if (!why.empty()) {
    // No driver, GPU or NCCL here: creating the communicator says so, on every rank, at once.
    try {
      lockstep::testing::run_ranks_as_threads(1, options, [](Communicator&) {});
      ADD_FAILURE() << "a communicator on nccl was created without " << why;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()), why);
      EXPECT_NE(why.find("any other backend"), std::string::npos) << why;
    }
    return;
  }
  lockstep::testing::run_ranks_as_threads(1, options, [](Communicator& comm) {
    EXPECT_TRUE(comm.takes_device_memory());
    std::vector<float> host{1.5f, -2.0f, 3.25f};
    comm.allreduce(host.data(), host.size(), DType::f32, ReduceOp::sum)->wait();  // staged through the GPU
    EXPECT_EQ(host, (std::vector<float>{1.5f, -2.0f, 3.25f}));
    std::vector<std::int64_t> ints{7, -7};
    comm.allreduce(ints.data(), ints.size(), DType::i64, ReduceOp::avg)->wait();
    EXPECT_EQ(ints, (std::vector<std::int64_t>{7, -7}));
    const auto& cuda = nccl::cuda_driver();
    OnGpu0 on_gpu(cuda);
    CUdeviceptr device = 0;
    ASSERT_EQ(cuda.mem_alloc(&device, sizeof(float) * host.size()), CUDA_SUCCESS);
    ASSERT_EQ(cuda.memcpy_htod(device, host.data(), sizeof(float) * host.size()), CUDA_SUCCESS);
    comm.allreduce(reinterpret_cast<void*>(device), host.size(), DType::f32, ReduceOp::avg)->wait();
    std::vector<float> back(host.size());
    ASSERT_EQ(cuda.memcpy_dtoh(back.data(), device, sizeof(float) * back.size()), CUDA_SUCCESS);
    EXPECT_EQ(back, host);
    comm.barrier()->wait();
    cuda.mem_free(device);
  });
}

// GPU memory handed to a backend that reads host memory is a ConfigError naming it, not a crash.
TEST(Nccl, GpuMemoryGivenToAHostBackendIsAClearError) {
  std::vector<float> host(4, 1.0f);
  EXPECT_FALSE(nccl::is_gpu_memory(host.data()));
  EXPECT_FALSE(nccl::is_gpu_memory(nullptr));
  if (!why_no_nccl().empty()) GTEST_SKIP() << "needs a GPU: " << why_no_nccl();
  const auto& cuda = nccl::cuda_driver();
  OnGpu0 on_gpu(cuda);
  CUdeviceptr device = 0;
  ASSERT_EQ(cuda.mem_alloc(&device, sizeof(float) * host.size()), CUDA_SUCCESS);
  void* gpu = reinterpret_cast<void*>(device);
  EXPECT_TRUE(nccl::is_gpu_memory(gpu));
  CommOptions options;
  options.backend = "shm";
  lockstep::testing::run_ranks_as_threads(1, options, [&](Communicator& comm) {
    try {
      comm.allreduce(gpu, host.size(), DType::f32, ReduceOp::sum)->wait();
      ADD_FAILURE() << "shm took GPU memory";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("GPU memory"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("nccl"), std::string::npos) << e.what();
    }
  });
  cuda.mem_free(device);
}

// An event to wait for on the GPU means nothing to a backend that reads host memory: refused by
// name before anything runs (the event is never touched, so none is needed here).
TEST(Nccl, AnEventGivenToAHostBackendIsAClearError) {
  CommOptions options;
  options.backend = "shm";
  int not_an_event = 0;
  lockstep::testing::run_ranks_as_threads(1, options, [&](Communicator& comm) {
    std::vector<float> host(4, 1.0f);
    for (bool scatter : {false, true}) {
      try {
        const DeviceReady ready{&not_an_event};
        if (scatter)
          comm.reduce_scatter(host.data(), host.data(), host.size(), DType::f32, ReduceOp::sum, ready)->wait();
        else
          comm.allreduce(host.data(), host.data(), host.size(), DType::f32, ReduceOp::sum, ready)->wait();
        ADD_FAILURE() << "shm took an event to wait for";
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("an event to wait for on the GPU"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("nccl"), std::string::npos) << e.what();
      }
    }
    EXPECT_EQ(host, std::vector<float>(4, 1.0f));  // nothing ran
  });
}

// A collective given the caller's event runs after the kernels before that event, without the
// host waiting: the caller's stream is held by the GPU until the test lets it go, then writes
// the send buffer, then records the event. The all-reduce (out of place, a world of one: a copy)
// must deliver what that write put there, not what the buffer held when the call was made.
TEST(Nccl, ACollectiveGivenTheCallersEventRunsAfterItOnTheGpu) {
  if (!why_no_nccl().empty()) GTEST_SKIP() << "needs a GPU: " << why_no_nccl();
  const StreamTools tools = StreamTools::load();
  if (!tools.complete()) GTEST_SKIP() << "this driver lacks stream memory operations";
  const auto& cuda = nccl::cuda_driver();
  CommOptions options;
  options.backend = "nccl";
  lockstep::testing::run_ranks_as_threads(1, options, [&](Communicator& comm) {
    OnGpu0 on_gpu(cuda);
    constexpr std::size_t n = 4;
    void* pinned = nullptr;  // [0]: the gate; [1..n]: the values the held stream writes
    ASSERT_EQ(tools.host_alloc(&pinned, sizeof(std::uint32_t) * (1 + n), CU_MEMHOSTALLOC_DEVICEMAP), CUDA_SUCCESS);
    auto* gate = static_cast<std::uint32_t*>(pinned);
    auto* values = reinterpret_cast<float*>(gate + 1);
    *gate = 0;
    for (std::size_t i = 0; i < n; ++i) values[i] = 1.5f + float(i);
    CUdeviceptr gate_on_gpu = 0, send = 0, recv = 0;
    ASSERT_EQ(tools.host_device_pointer(&gate_on_gpu, gate, 0), CUDA_SUCCESS);
    ASSERT_EQ(cuda.mem_alloc(&send, sizeof(float) * n), CUDA_SUCCESS);
    ASSERT_EQ(cuda.mem_alloc(&recv, sizeof(float) * n), CUDA_SUCCESS);
    const std::vector<float> zeros(n, 0.0f);
    ASSERT_EQ(cuda.memcpy_htod(send, zeros.data(), sizeof(float) * n), CUDA_SUCCESS);
    ASSERT_EQ(cuda.memcpy_htod(recv, zeros.data(), sizeof(float) * n), CUDA_SUCCESS);
    CUstream caller = nullptr;
    CUevent written = nullptr;
    ASSERT_EQ(cuda.stream_create(&caller, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    ASSERT_EQ(tools.event_create(&written, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
    ASSERT_EQ(tools.wait_value(caller, gate_on_gpu, 1, CU_STREAM_WAIT_VALUE_GEQ), CUDA_SUCCESS);
    ASSERT_EQ(cuda.memcpy_htod_async(send, values, sizeof(float) * n, caller), CUDA_SUCCESS);
    ASSERT_EQ(tools.event_record(written, caller), CUDA_SUCCESS);
    auto work = comm.allreduce(reinterpret_cast<void*>(send), reinterpret_cast<void*>(recv), n, DType::f32,
                               ReduceOp::sum, DeviceReady{written});
    // The caller went on at once; the collective cannot have finished while the stream is held.
    EXPECT_FALSE(work->done());
    std::atomic_thread_fence(std::memory_order_seq_cst);
    *static_cast<volatile std::uint32_t*>(gate) = 1;  // the GPU reads it through the mapping
    work->wait();
    std::vector<float> got(n);
    ASSERT_EQ(cuda.memcpy_dtoh(got.data(), recv, sizeof(float) * n), CUDA_SUCCESS);
    EXPECT_EQ(got, std::vector<float>(values, values + n));
    tools.synchronize(caller);
    tools.event_destroy(written);
    cuda.stream_destroy(caller);
    cuda.mem_free(send);
    cuda.mem_free(recv);
    tools.free_host(pinned);
  });
}
