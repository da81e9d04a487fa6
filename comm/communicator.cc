#include "comm/communicator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <numeric>
#include <sstream>

#include "comm/flight_recorder.h"
#include "core/error.h"
#include "core/faults.h"
#include "core/trace.h"

namespace dtrain::comm {

namespace {
std::atomic<bool> g_default_check{false};
}  // namespace

void set_default_call_check(bool on) { g_default_check.store(on, std::memory_order_relaxed); }
bool default_call_check() { return g_default_check.load(std::memory_order_relaxed); }
namespace {

std::exception_ptr abandoned_error(const detail::WorkState& state, const std::string& why) {
  return std::make_exception_ptr(CommError(describe(state.info()) +
                                           " was abandoned: an earlier collective on this "
                                           "communicator failed (" +
                                           why + ")"));
}

}  // namespace

Communicator::Communicator(int rank, int size, std::vector<int> world_ranks,
                           std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), world_ranks_(std::move(world_ranks)), timeout_(timeout) {
  static std::atomic<int64_t> next_id{0};
  id_ = next_id++;
  DTRAIN_CHECK_AS(CommError, size_ > 0 && rank_ >= 0 && rank_ < size_, "invalid rank ", rank_,
                  " for a communicator of size ", size_);
  if (world_ranks_.empty()) {
    world_ranks_.resize(size_);
    std::iota(world_ranks_.begin(), world_ranks_.end(), 0);
  }
  shared_ranks_ = std::make_shared<const std::vector<int>>(world_ranks_);
  on_break_ = std::make_shared<const detail::WorkState::BreakHandler>(
      [health = health_](const std::string& why) { health->mark(why); });
  if (const char* v = std::getenv("DTRAIN_COMM_CHECK")) {
    const std::string value = v;
    DTRAIN_CHECK_AS(
        ConfigError, value == "0" || value == "1" || value.empty(),
        "DTRAIN_COMM_CHECK must be 1 (verify every collective across ranks) or 0, got '", value,
        "'");
    if (!value.empty()) check_mode_ = value == "1" ? 1 : 0;
  }
}

void Communicator::Health::mark(const std::string& why) {
  std::deque<std::weak_ptr<detail::WorkState>> abandoned;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (broken.exchange(true)) return;
    reason = why;
    abandoned.swap(pending);
  }
  for (auto& weak : abandoned) {
    // fail() leaves an op that finished meanwhile as it is: only those in flight are abandoned.
    if (auto state = weak.lock()) state->fail(abandoned_error(*state, why));
  }
}

void Communicator::Health::track(const std::shared_ptr<detail::WorkState>& state) {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!broken) {
      // Forget finished ops first, so the list holds what is in flight (and O(1) per op:
      // scanning it all made issuing N queued collectives cost N^2).
      while (!pending.empty()) {
        auto s = pending.front().lock();
        if (s && !s->is_completed()) break;
        pending.pop_front();
      }
      pending.push_back(state);
      return;
    }
    why = reason;
  }
  // Broken since submit() checked: this op would only wait out its timeout.
  state->fail(abandoned_error(*state, why));
}

bool Communicator::is_broken() const { return health_->broken.load(); }

std::string Communicator::broken_reason() const {
  std::lock_guard<std::mutex> lock(health_->mu);
  return health_->reason;
}

void Communicator::mark_broken(const std::string& reason) { health_->mark(reason); }

std::vector<int> Communicator::to_world_ranks(const std::vector<int>& members) const {
  std::vector<int> out;
  out.reserve(members.size());
  for (int m : members) out.push_back(world_ranks_.at(m));
  return out;
}

namespace {

void check_tensor(const char* name, const char* role, const at::Tensor& t, c10::DeviceType device) {
  DTRAIN_CHECK_AS(CommError, t.defined(), name, ": the ", role, " tensor is undefined");
  DTRAIN_CHECK_AS(CommError, t.is_contiguous(), name, ": the ", role,
                  " tensor must be contiguous (sizes ", t.sizes(), ", strides ", t.strides(),
                  "); pass tensor.contiguous()");
  DTRAIN_CHECK_AS(CommError, is_supported_dtype(t.scalar_type()), name, ": dtype ", t.scalar_type(),
                  " is not supported; use one of fp32, fp64, fp16, bf16, int32, int64, uint8");
  // MPI and Gloo stage CUDA tensors through host memory, so they accept both.
  DTRAIN_CHECK_AS(CommError, device != c10::kCUDA || t.is_cuda(), name, ": the ", role,
                  " tensor is on ", t.device(), " but this communicator (nccl) needs CUDA tensors");
}

}  // namespace

Work Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  return submit(OpKind::kAllReduce, "all_reduce", tensor, tensor, op, 0);
}

Work Communicator::reduce_scatter(const at::Tensor& input_flat, const at::Tensor& output_shard,
                                  ReduceOp op) {
  return submit(OpKind::kReduceScatter, "reduce_scatter", input_flat, output_shard, op, 0);
}

namespace {

// Collectives that only move data take bool tensors (masks, BatchNorm-style flags) as the
// bytes they are.
at::Tensor as_moved(const at::Tensor& t) {
  return t.defined() && t.scalar_type() == at::kBool ? t.view(at::kByte) : t;
}

}  // namespace

Work Communicator::all_gather(const at::Tensor& input_shard, const at::Tensor& output_flat) {
  return submit(OpKind::kAllGather, "all_gather", as_moved(input_shard), as_moved(output_flat),
                ReduceOp::kSum, 0);
}

Work Communicator::broadcast(const at::Tensor& tensor, int root) {
  const at::Tensor t = as_moved(tensor);
  return submit(OpKind::kBroadcast, "broadcast", t, t, ReduceOp::kSum, root);
}

Work Communicator::barrier() {
  return submit(OpKind::kBarrier, "barrier", at::Tensor(), at::Tensor(), ReduceOp::kSum, 0);
}

Work Communicator::submit(OpKind kind, const char* name, const at::Tensor& input,
                          const at::Tensor& output, ReduceOp op, int root) {
  DTRAIN_CHECK_AS(CommError, !is_broken(), name, " on rank ", rank_,
                  ": this communicator is unusable after an earlier failure (", broken_reason(),
                  "). Restart the job; ranks cannot be brought back in step.");
  CollectiveInfo info;
  info.op = name;
  const char* backend_name = backend_name_.load(std::memory_order_relaxed);
  if (backend_name == nullptr) {  // backend() is virtual: not callable at construction
    backend_name = interned_name(backend());
    backend_name_.store(backend_name, std::memory_order_relaxed);
  }
  info.backend = backend_name;
  info.rank = rank_;
  info.ranks = shared_ranks_;
  if (kind != OpKind::kBarrier) {
    check_tensor(name, kind == OpKind::kAllGather ? "input shard" : "input", input, device_type());
    info.dtype = input.scalar_type();
    info.numel = input.numel();
  }
  if (kind == OpKind::kReduceScatter || kind == OpKind::kAllGather) {
    check_tensor(name, "output", output, device_type());
    DTRAIN_CHECK_AS(CommError, input.scalar_type() == output.scalar_type(), name,
                    ": input and output dtypes differ (", input.scalar_type(), " vs ",
                    output.scalar_type(), ")");
    DTRAIN_CHECK_AS(CommError, input.device() == output.device(), name,
                    ": input and output devices differ (", input.device(), " vs ", output.device(),
                    ")");
    const at::Tensor& flat = kind == OpKind::kReduceScatter ? input : output;
    const at::Tensor& shard = kind == OpKind::kReduceScatter ? output : input;
    DTRAIN_CHECK_AS(CommError, flat.numel() == shard.numel() * size_, name,
                    ": the flat tensor must hold world size x shard elements: ", flat.numel(),
                    " != ", size_, " x ", shard.numel(),
                    ". Pad the flat tensor to a multiple of the world size.");
  }
  if (kind == OpKind::kAllReduce || kind == OpKind::kReduceScatter) {
    DTRAIN_CHECK_AS(CommError, op != ReduceOp::kAvg || c10::isFloatingType(info.dtype), name,
                    ": AVG needs a floating dtype, got ", dtype_name(info.dtype),
                    "; use SUM and divide");
  }
  if (kind == OpKind::kBroadcast) {
    DTRAIN_CHECK_AS(CommError, root >= 0 && root < size_, name, ": root ", root,
                    " is not a rank of this communicator (size ", size_, ")");
  }
  if (!checking_ && (check_mode_ == 1 || (check_mode_ < 0 && default_call_check()))) {
    verify_same_call(kind, info, output.defined() ? output.numel() : 0, op, root);
  }
  info.seq = next_seq_++;
  info.comm_id = id_;
  // Fault injection (core/faults.h): the world communicator's #seq is skipped on one rank.
  static const std::optional<faults::StepRank> skip = faults::step_rank("SKIP_COLLECTIVE");
  if (skip && id_ == 0 && info.seq == skip->step && rank_ == skip->rank) return Work();
  if (trace::enabled()) info.label = trace::current_label();
  // Zero-element collectives are no-ops on every rank alike (shapes agree across ranks).
  if (kind != OpKind::kBarrier && info.numel == 0) return Work();

  auto state = std::make_shared<detail::WorkState>(std::move(info), timeout_);
  state->on_break = on_break_;
  state->flight_ticket = flight::issued(state->info(), state->enqueued_ns());
  health_->track(state);
  Collective c{kind, input, output, op, root, state};
  enqueue(std::move(c));
  return Work(state);
}

namespace {

// One rank's call as the check exchanges it.
struct CallPrint {
  static constexpr int64_t kMagic = 0x64747261696e;  // "dtrain": pairs only with another check
  static constexpr int kFields = 8;
  int64_t f[kFields];
  int64_t magic() const { return f[0]; }
};

const char* kind_name(int64_t kind) {
  static const char* const names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                      "barrier"};
  return kind >= 0 && kind < 5 ? names[kind] : "an unknown collective";
}

std::string describe_call(const CallPrint& p, const CallPrint& mine) {
  if (p.magic() != CallPrint::kMagic) {
    return "not a checked collective (is DTRAIN_COMM_CHECK=1 set on every rank?)";
  }
  const int64_t kind = p.f[1];
  std::ostringstream os;
  os << kind_name(kind);
  if (kind == 4) return os.str();
  os << " of " << p.f[3] << " " << dtype_name(static_cast<c10::ScalarType>(p.f[2])) << " element"
     << (p.f[3] == 1 ? "" : "s");
  if (kind == 1 || kind == 2) os << " (output " << p.f[4] << ")";
  if (p.f[5] >= 0) os << ", " << to_string(static_cast<ReduceOp>(p.f[5]));
  if (p.f[6] >= 0) os << " from root " << p.f[6];
  if (p.f[7] != mine.f[7])
    os << " as its collective #" << p.f[7] << " (this rank's #" << mine.f[7] << ")";
  return os.str();
}

}  // namespace

void Communicator::verify_same_call(OpKind kind, const CollectiveInfo& info, int64_t output_numel,
                                    ReduceOp op, int root) {
  const bool reduces = kind == OpKind::kAllReduce || kind == OpKind::kReduceScatter;
  CallPrint mine{{CallPrint::kMagic, static_cast<int64_t>(kind),
                  kind == OpKind::kBarrier ? -1 : static_cast<int64_t>(info.dtype), info.numel,
                  kind == OpKind::kReduceScatter || kind == OpKind::kAllGather ? output_numel : 0,
                  reduces ? static_cast<int64_t>(op) : -1, kind == OpKind::kBroadcast ? root : -1,
                  next_seq_}};
  at::Tensor all;
  checking_ = true;
  try {
    at::Tensor t =
        at::tensor(at::ArrayRef<int64_t>(mine.f, CallPrint::kFields), at::kLong).to(device());
    all = at::empty({int64_t{size_} * CallPrint::kFields}, t.options());
    all_gather(t, all).wait();
  } catch (...) {
    checking_ = false;
    throw;
  }
  checking_ = false;
  all = all.cpu().contiguous();
  const int64_t* a = all.data_ptr<int64_t>();
  std::vector<int> differ;
  for (int r = 0; r < size_; ++r) {
    if (!std::equal(mine.f, mine.f + CallPrint::kFields, a + r * CallPrint::kFields)) {
      differ.push_back(r);
    }
  }
  if (differ.empty()) return;
  // Name the ranks that disagree with rank 0 (or, on those ranks, rank 0 itself).
  std::ostringstream os;
  CollectiveInfo named = info;
  named.seq = next_seq_;  // the number the collective gets after the check's own
  os << describe(named) << ": DTRAIN_COMM_CHECK found that the ranks issued different "
     << "collectives. This rank (" << rank_ << ") issued " << describe_call(mine, mine);
  size_t shown = 0;
  for (int r : differ) {
    if (++shown > 4) {
      os << "; and " << differ.size() - 4 << " more";
      break;
    }
    CallPrint theirs;
    std::copy(a + r * CallPrint::kFields, a + (r + 1) * CallPrint::kFields, theirs.f);
    os << "; rank " << r << " issued " << describe_call(theirs, mine);
  }
  os << ". Every rank must issue the same collectives, with the same dtype, element count, "
        "reduction and root, in the same order.";
  mark_broken(os.str());
  DTRAIN_FAIL(CommError, os.str());
}

std::shared_ptr<Communicator> Communicator::split(int color, int key) {
  // Everyone learns everyone's (color, key) through the communicator itself.
  auto opts = at::TensorOptions().dtype(at::kLong).device(device());
  at::Tensor mine = at::tensor({int64_t{color}, int64_t{key}}, at::kLong).to(device());
  at::Tensor all = at::empty({2 * int64_t{size_}}, opts);
  all_gather(mine, all).wait();
  all = all.cpu();
  auto a = all.accessor<int64_t, 1>();
  std::vector<int> members;
  for (int r = 0; r < size_; ++r) {
    if (color >= 0 && a[2 * r] == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int x, int y) { return a[2 * x + 1] < a[2 * y + 1]; });
  auto me = std::find(members.begin(), members.end(), rank_);
  int new_rank = me == members.end() ? -1 : static_cast<int>(me - members.begin());
  auto part = split_impl(color, key, members, new_rank, next_split_++);
  if (part) part->world_nodes_ = world_nodes_;
  return part;
}

void Communicator::set_world_nodes(std::vector<int> nodes) {
  DTRAIN_CHECK_AS(UsageError, nodes.empty() || nodes.size() == world_ranks_.size(),
                  "set_world_nodes: ", nodes.size(), " nodes for ", world_ranks_.size(),
                  " world ranks");
  world_nodes_ = std::make_shared<const std::vector<int>>(std::move(nodes));
}

int Communicator::local_size() const {
  const auto& nodes = *world_nodes_;
  const int me = world_ranks_[static_cast<size_t>(rank_)];
  if (nodes.empty() || static_cast<size_t>(me) >= nodes.size()) return size_;
  int n = 0;
  for (int w : world_ranks_) n += nodes[static_cast<size_t>(w)] == nodes[static_cast<size_t>(me)];
  return n;
}

}  // namespace dtrain::comm
