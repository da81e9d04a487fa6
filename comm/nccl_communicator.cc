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

#include "core/error.h"

#ifdef DTRAIN_WITH_MPI
#include "comm/mpi_communicator.h"
#endif

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
//
// Threads: callers enqueue under comm_mu_; the watchdog polls events and, on an error or an
// overdue op, aborts under the same mutex, so an abort never races an enqueue and happens
// once (the destructor destroys only a communicator that was not aborted).
class NcclGroup {
 public:
  NcclGroup(ncclComm_t comm, int device, std::chrono::milliseconds timeout,
            c10::intrusive_ptr<c10d::Store> store = {})
      : comm_(comm), device_(device), timeout_(timeout), store_(std::move(store)) {
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
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      if (!aborted_) {
        cudaStreamSynchronize(stream_);
        ncclCommDestroy(comm_);
      }
    }
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  ncclComm_t comm() const { return comm_; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  float* scratch() const { return static_cast<float*>(scratch_); }
  // Held while issuing NCCL calls; the watchdog takes it to abort.
  std::mutex& comm_mutex() { return comm_mu_; }
  bool aborted() const { return aborted_; }

  // Records the start of the next op on stream(), for its device-side duration.
  std::shared_ptr<cudaEvent_t> record_start() { return record(); }

  // Records completion of the ops just issued on stream() for `state`.
  void track(std::shared_ptr<detail::WorkState> state, std::shared_ptr<cudaEvent_t> start,
             std::vector<at::Tensor> keep_alive) {
    auto done = record();
    const int device = device_;
    // Work::wait() makes the caller's stream wait for `done` instead of blocking the host.
    state->stream_wait = [done, device] {
      cudaSetDevice(device);
      cudaStreamWaitEvent(caller_stream(device), *done, 0);
    };
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({std::move(state), std::move(start), std::move(done),
                          std::move(keep_alive), std::chrono::steady_clock::now() + timeout_});
    }
    cv_.notify_all();
  }

 private:
  struct Pending {
    std::shared_ptr<detail::WorkState> state;
    std::shared_ptr<cudaEvent_t> start, done;
    std::vector<at::Tensor> keep_alive;
    std::chrono::steady_clock::time_point deadline;
  };

  std::shared_ptr<cudaEvent_t> record() {
    cudaEvent_t e;
    DTRAIN_CUDA(cudaEventCreate(&e));  // timing enabled: busy_seconds is device time
    DTRAIN_CUDA(cudaEventRecord(e, stream_));
    return std::shared_ptr<cudaEvent_t>(new cudaEvent_t(e), [](cudaEvent_t* p) {
      cudaEventDestroy(*p);
      delete p;
    });
  }

  void abort_once() {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (aborted_.exchange(true)) return;
    ncclCommAbort(comm_);
  }

  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait_for(lock, std::chrono::milliseconds(1), [&] { return stop_; });
      if (stop_ && pending_.empty()) return;
      for (auto it = pending_.begin(); it != pending_.end();) {
        cudaError_t q = cudaEventQuery(*it->done);
        if (q == cudaSuccess) {
          float ms = 0;
          if (cudaEventElapsedTime(&ms, *it->start, *it->done) == cudaSuccess) {
            it->state->set_busy_seconds(ms / 1000.0);
          }
          it->state->finish();
          it = pending_.erase(it);
          continue;
        }
        std::string error;
        bool late = false;
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm_, &async);
        if (q != cudaErrorNotReady) {
          error = std::string("CUDA error: ") + cudaGetErrorString(q);
        } else if (async != ncclSuccess && async != ncclInProgress) {
          error = std::string("NCCL error: ") + ncclGetErrorString(async) + " (" +
                  ncclGetLastError(comm_) + "; NCCL " + nccl_version() + ")";
        } else if (std::chrono::steady_clock::now() > it->deadline) {
          late = true;
          error = describe(it->state->info()) + " did not complete within " +
                  std::to_string(timeout_.count() / 1000.0) + " s on rank " +
                  std::to_string(it->state->info().rank) +
                  " (NCCL watchdog). Another rank skipped this collective, issued a different "
                  "one, or died: check the other ranks' logs. The NCCL communicator was "
                  "aborted; raise parallel.timeout_s or DTRAIN_COMM_TIMEOUT_S if the op is "
                  "legitimately slow.";
        }
        if (error.empty()) {
          ++it;
          continue;
        }
        // The communicator is unusable: abort, so kernels waiting on absent peers return
        // and the process can exit; fail this op (TimeoutError when late) and, through the
        // communicator it breaks, every other op still pending.
        std::list<Pending> failed;
        failed.swap(pending_);
        lock.unlock();
        abort_once();
        Pending& culprit = *it;  // list::swap keeps iterators valid: now in `failed`
        if (late) {
          culprit.state->time_out(error);
        } else {
          culprit.state->fail(backend_failure(culprit.state->info(), "nccl", error));
          culprit.state->notify_break(error);
        }
        for (auto& p : failed) {
          if (!p.state->is_completed()) {
            p.state->fail(std::make_exception_ptr(
                CommError(describe(p.state->info()) + " failed: " + error)));
          }
        }
        lock.lock();
        break;
      }
      if (stop_ && pending_.empty()) return;
    }
  }

  ncclComm_t comm_;
  int device_;
  std::chrono::milliseconds timeout_;
  // Rank 0 serves the store the unique id went through: it lives as long as the group, so
  // no peer finds it gone before reading the id.
  c10::intrusive_ptr<c10d::Store> store_;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::list<Pending> pending_;
  bool stop_ = false;
  std::mutex comm_mu_;
  std::atomic<bool> aborted_{false};
  std::thread watchdog_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclGroup> group, int rank, int size,
                   std::vector<int> world_ranks, std::chrono::milliseconds timeout)
      : Communicator(rank, size, std::move(world_ranks), timeout), group_(std::move(group)) {}

  std::string backend() const override { return "nccl"; }
  c10::Device device() const override {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(group_->device()));
  }

 protected:
  void enqueue(Collective c) override {
    NcclGroup& g = *group_;
    std::lock_guard<std::mutex> lock(g.comm_mutex());
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
    auto start = g.record_start();
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
      case OpKind::kP2P: {
        // One NCCL group: its sends and receives progress together. NCCL carries no header:
        // a receive of another size is NCCL's undefined behaviour (the collective check's
        // counterpart for pipelines is the schedule, the same on both stages).
        DTRAIN_NCCL(ncclGroupStart(), comm);
        for (const P2POp& op : c.p2p) {
          const size_t bytes = static_cast<size_t>(op.tensor.numel() * op.tensor.element_size());
          if (bytes == 0) continue;
          if (op.kind == P2POp::kSend) {
            DTRAIN_NCCL(ncclSend(op.tensor.data_ptr(), bytes, ncclUint8, op.peer, comm, s), comm);
          } else {
            DTRAIN_NCCL(ncclRecv(op.tensor.data_ptr(), bytes, ncclUint8, op.peer, comm, s), comm);
          }
        }
        DTRAIN_NCCL(ncclGroupEnd(), comm);
        break;
      }
    }
    std::vector<at::Tensor> keep{c.input, c.output};
    for (const P2POp& op : c.p2p) keep.push_back(op.tensor);
    g.track(c.state, std::move(start), std::move(keep));
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

std::shared_ptr<Communicator> make_nccl_world(RankInfo& info, std::chrono::milliseconds timeout) {
  int devices = 0;
  DTRAIN_CUDA(cudaGetDeviceCount(&devices));
  DTRAIN_CHECK_AS(CommError, devices > 0, "backend nccl needs a CUDA device; none is visible");
  const int device = info.local_rank % devices;
  DTRAIN_CUDA(cudaSetDevice(device));
  ncclUniqueId id;
  if (info.rank == 0) DTRAIN_NCCL(ncclGetUniqueId(&id), nullptr);
  std::vector<uint8_t> bytes(reinterpret_cast<uint8_t*>(&id),
                             reinterpret_cast<uint8_t*>(&id) + sizeof(id));
  c10::intrusive_ptr<c10d::Store> store;
  if (info.world_size > 1) {
#ifdef DTRAIN_WITH_MPI
    const bool through_mpi = info.mpi_launched;
#else
    const bool through_mpi = false;  // no MPI in this build: the TCPStore (MASTER_ADDR)
#endif
    if (through_mpi) {
#ifdef DTRAIN_WITH_MPI
      auto mpi = make_mpi_world(timeout, info.node_key);
      info.node_of = mpi->world_nodes();
      at::Tensor t = at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte);
      mpi->broadcast(t, 0).wait();
#endif
    } else {
      store = make_tcp_store(info, timeout);
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
  auto group = std::make_shared<NcclGroup>(comm, device, timeout, std::move(store));
  return std::make_shared<NcclCommunicator>(group, info.rank, info.world_size, std::vector<int>{},
                                            timeout);
}

}  // namespace dtrain::comm
