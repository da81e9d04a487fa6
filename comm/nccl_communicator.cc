#include "comm/nccl_communicator.h"

#include <ATen/ATen.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>

#include "comm/mpi_communicator.h"
#include "core/error.h"

#ifdef DTRAIN_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace dtrain::comm {
namespace {

std::string nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

#define DTRAIN_CUDA(call)                                             \
  do {                                                                \
    cudaError_t dtrain_cuda_rc = (call);                              \
    DTRAIN_CHECK_AS(CommError, dtrain_cuda_rc == cudaSuccess, #call,  \
                    " failed: ", cudaGetErrorString(dtrain_cuda_rc)); \
  } while (0)

#define DTRAIN_NCCL(call, comm)                                                                    \
  do {                                                                                             \
    ncclResult_t dtrain_nccl_rc = (call);                                                          \
    DTRAIN_CHECK_AS(CommError, dtrain_nccl_rc == ncclSuccess, #call,                               \
                    " failed: ", ncclGetErrorString(dtrain_nccl_rc), " (", ncclGetLastError(comm), \
                    "; NCCL ", nccl_version(), ")");                                               \
  } while (0)

// The stream the caller's kernels run on. A CPU-only LibTorch cannot hold CUDA tensors, so
// there the legacy default stream is as good as any.
cudaStream_t caller_stream(int device) {
#ifdef DTRAIN_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
  return cudaStreamLegacy;
#endif
}

ncclDataType_t nccl_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return ncclFloat32;
    case c10::kDouble:
      return ncclFloat64;
    case c10::kHalf:
      return ncclFloat16;
    case c10::kBFloat16:
      return ncclBfloat16;
    case c10::kInt:
      return ncclInt32;
    case c10::kLong:
      return ncclInt64;
    case c10::kByte:
      return ncclUint8;
    default:
      DTRAIN_FAIL(CommError, "nccl backend: unsupported dtype ", t);
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

// Owns the NCCL communicator, its stream and the watchdog; shared with in-flight work.
class NcclGroup {
 public:
  NcclGroup(ncclComm_t comm, int device, std::chrono::milliseconds timeout)
      : comm_(comm), device_(device), timeout_(timeout) {
    DTRAIN_CUDA(cudaSetDevice(device_));
    DTRAIN_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    DTRAIN_CUDA(cudaMalloc(&scratch_, sizeof(float)));
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclGroup() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
    cudaSetDevice(device_);
    if (aborted_) {
      ncclCommAbort(comm_);
    } else {
      cudaStreamSynchronize(stream_);
      ncclCommDestroy(comm_);
    }
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  ncclComm_t comm() const { return comm_; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  float* scratch() const { return static_cast<float*>(scratch_); }

  // Records completion of the ops just issued on stream() for `state`.
  void track(std::shared_ptr<detail::WorkState> state, std::vector<at::Tensor> keep_alive) {
    cudaEvent_t done;
    DTRAIN_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    DTRAIN_CUDA(cudaEventRecord(done, stream_));
    int device = device_;
    // Later work on the caller's stream must see the result: order it after `done`.
    // The event lives as long as the WorkState.
    auto holder = std::shared_ptr<cudaEvent_t>(new cudaEvent_t(done), [](cudaEvent_t* e) {
      cudaEventDestroy(*e);
      delete e;
    });
    state->after_wait = [holder, device] {
      cudaSetDevice(device);
      cudaStreamWaitEvent(caller_stream(device), *holder, 0);
    };
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({std::move(state), holder, std::move(keep_alive),
                          std::chrono::steady_clock::now() + timeout_});
    }
    cv_.notify_all();
  }

  bool aborted() const { return aborted_; }

 private:
  struct Pending {
    std::shared_ptr<detail::WorkState> state;
    std::shared_ptr<cudaEvent_t> done;
    std::vector<at::Tensor> keep_alive;
    std::chrono::steady_clock::time_point deadline;
  };

  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait_for(lock, std::chrono::milliseconds(1), [&] { return stop_; });
      if (stop_ && pending_.empty()) return;
      for (auto it = pending_.begin(); it != pending_.end();) {
        cudaError_t q = cudaEventQuery(*it->done);
        if (q == cudaSuccess) {
          it->state->finish();
          it = pending_.erase(it);
          continue;
        }
        std::string error;
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm_, &async);
        if (q != cudaErrorNotReady) {
          error = std::string("CUDA error: ") + cudaGetErrorString(q);
        } else if (async != ncclSuccess && async != ncclInProgress) {
          error = std::string("NCCL error: ") + ncclGetErrorString(async) + " (" +
                  ncclGetLastError(comm_) + "; NCCL " + nccl_version() + ")";
        } else if (std::chrono::steady_clock::now() > it->deadline) {
          error = "watchdog: not complete after " + std::to_string(timeout_.count() / 1000.0) +
                  " s; aborting the NCCL communicator";
        }
        if (error.empty()) {
          ++it;
          continue;
        }
        // The communicator is unusable: fail everything in flight and abort, so kernels
        // waiting on absent peers return and the process can exit.
        aborted_ = true;
        ncclCommAbort(comm_);
        for (auto& p : pending_) {
          p.state->fail(
              std::make_exception_ptr(CommError(describe(p.state->info()) + " failed: " + error)));
        }
        pending_.clear();
        break;
      }
      if (stop_ && pending_.empty()) return;
    }
  }

  ncclComm_t comm_;
  int device_;
  std::chrono::milliseconds timeout_;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::list<Pending> pending_;
  bool stop_ = false;
  std::atomic<bool> aborted_{false};
  std::thread watchdog_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclGroup> group, int rank, int size,
                   std::vector<int> world_ranks, std::chrono::milliseconds timeout)
      : Communicator(rank, size, std::move(world_ranks), timeout), group_(std::move(group)) {}

  std::string backend() const override { return "nccl"; }
  c10::DeviceType device_type() const override { return c10::kCUDA; }

 protected:
  void enqueue(Collective c) override {
    NcclGroup& g = *group_;
    DTRAIN_CHECK_AS(CommError, !g.aborted(), describe(c.state->info()),
                    ": the NCCL communicator was aborted after an earlier error");
    DTRAIN_CUDA(cudaSetDevice(g.device()));
    // The collective must see what the caller's stream wrote before this call.
    cudaEvent_t ready;
    DTRAIN_CUDA(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    DTRAIN_CUDA(cudaEventRecord(ready, caller_stream(g.device())));
    DTRAIN_CUDA(cudaStreamWaitEvent(g.stream(), ready, 0));
    DTRAIN_CUDA(cudaEventDestroy(ready));
    c.state->mark_started();
    ncclComm_t comm = g.comm();
    cudaStream_t s = g.stream();
    switch (c.kind) {
      case OpKind::kAllReduce:
        DTRAIN_NCCL(ncclAllReduce(c.input.data_ptr(), c.input.data_ptr(),
                                  static_cast<size_t>(c.input.numel()),
                                  nccl_dtype(c.input.scalar_type()), nccl_op(c.op), comm, s),
                    comm);
        break;
      case OpKind::kBroadcast:
        DTRAIN_NCCL(ncclBroadcast(c.input.data_ptr(), c.input.data_ptr(),
                                  static_cast<size_t>(c.input.numel()),
                                  nccl_dtype(c.input.scalar_type()), c.root, comm, s),
                    comm);
        break;
      case OpKind::kReduceScatter:
        DTRAIN_NCCL(ncclReduceScatter(c.input.data_ptr(), c.output.data_ptr(),
                                      static_cast<size_t>(c.output.numel()),
                                      nccl_dtype(c.input.scalar_type()), nccl_op(c.op), comm, s),
                    comm);
        break;
      case OpKind::kAllGather:
        DTRAIN_NCCL(ncclAllGather(c.input.data_ptr(), c.output.data_ptr(),
                                  static_cast<size_t>(c.input.numel()),
                                  nccl_dtype(c.input.scalar_type()), comm, s),
                    comm);
        break;
      case OpKind::kBarrier:
        DTRAIN_NCCL(ncclAllReduce(g.scratch(), g.scratch(), 1, ncclFloat32, ncclSum, comm, s),
                    comm);
        break;
    }
    g.track(c.state, {c.input, c.output});
  }

  std::shared_ptr<Communicator> split_impl(int color, int key, const std::vector<int>& members,
                                           int new_rank, int64_t /*split_id*/) override {
    ncclComm_t out = nullptr;
    DTRAIN_CUDA(cudaSetDevice(group_->device()));
    DTRAIN_NCCL(
        ncclCommSplit(group_->comm(), color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &out, nullptr),
        group_->comm());
    if (color < 0 || out == nullptr) return nullptr;
    auto group = std::make_shared<NcclGroup>(out, group_->device(), timeout());
    return std::make_shared<NcclCommunicator>(group, new_rank, static_cast<int>(members.size()),
                                              to_world_ranks(members), timeout());
  }

 private:
  std::shared_ptr<NcclGroup> group_;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_world(const RankInfo& info,
                                              std::chrono::milliseconds timeout) {
  int devices = 0;
  DTRAIN_CUDA(cudaGetDeviceCount(&devices));
  DTRAIN_CHECK_AS(CommError, devices > 0, "backend nccl needs a CUDA device; none is visible");
  const int device = info.local_rank % devices;
  DTRAIN_CUDA(cudaSetDevice(device));
  ncclUniqueId id;
  if (info.rank == 0) DTRAIN_NCCL(ncclGetUniqueId(&id), nullptr);
  std::vector<uint8_t> bytes(reinterpret_cast<uint8_t*>(&id),
                             reinterpret_cast<uint8_t*>(&id) + sizeof(id));
  if (info.world_size > 1) {
    if (info.mpi_launched) {
      auto mpi = make_mpi_world(timeout);
      at::Tensor t = at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte);
      mpi->broadcast(t, 0).wait();
    } else {
      auto store = make_tcp_store(info, timeout);
      const std::string key = "dtrain/nccl/unique_id";
      if (info.rank == 0) {
        store->set(key, bytes);
      } else {
        bytes = store->get(key);
      }
    }
  }
  std::memcpy(&id, bytes.data(), sizeof(id));
  ncclComm_t comm = nullptr;
  DTRAIN_NCCL(ncclCommInitRank(&comm, info.world_size, id, info.rank), comm);
  auto group = std::make_shared<NcclGroup>(comm, device, timeout);
  return std::make_shared<NcclCommunicator>(group, info.rank, info.world_size, std::vector<int>{},
                                            timeout);
}

}  // namespace dtrain::comm
