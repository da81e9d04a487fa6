#include "comm/communicator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>
#include <tuple>

#include "comm/flight_recorder.h"
#include "comm/staging.h"
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
  p2p_channels_ = std::make_shared<P2PChannels>();
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
  Collective c{kind, input, output, op, root, state, {}, nullptr};
  enqueue(std::move(c));
  return Work(state);
}

namespace {

// A point-to-point message's header: what was sent, for the receiver to check.
constexpr int kHeaderSlots = 16;
constexpr int kMaxP2PDims = kHeaderSlots - 4;
constexpr int64_t kP2PMagic = 0x7032706474726e;  // pairs only with another header
using Header = std::array<int64_t, kHeaderSlots>;

Header header_of(const at::Tensor& t) {
  Header h{};
  h[0] = kP2PMagic;
  h[1] = static_cast<int64_t>(t.scalar_type());
  h[2] = t.dim();
  h[3] = t.numel();
  for (int64_t d = 0; d < t.dim(); ++d) h[4 + d] = t.size(d);
  return h;
}

// "bf16 [4, 8]"
std::string header_text(const Header& h) {
  if (h[0] != kP2PMagic || h[2] < 0 || h[2] > kMaxP2PDims || h[1] < 0 ||
      h[1] >= static_cast<int64_t>(c10::ScalarType::NumOptions)) {
    return "something that is not a point-to-point message";
  }
  std::ostringstream os;
  os << dtype_name(static_cast<c10::ScalarType>(h[1])) << " [";
  for (int64_t d = 0; d < h[2]; ++d) os << (d ? ", " : "") << h[4 + d];
  os << "]";
  return os.str();
}

int transport_tag(int tag, bool payload) { return 2 * tag + (payload ? 1 : 0); }

constexpr int64_t kHeaderBytes = kHeaderSlots * static_cast<int64_t>(sizeof(int64_t));

// The bytes of the tensor a header describes.
int64_t payload_bytes(const Header& h) {
  return h[3] * static_cast<int64_t>(c10::elementSize(static_cast<c10::ScalarType>(h[1])));
}

// Whether a channel's later messages travel with their header (run_p2p): only up to this many
// bytes in its first message. A larger message costs a copy into the joint transfer, which
// takes longer than the second request it saves, and a message of another shape on that
// channel would carry as many zeros (a checkpoint's gathered state, then a small buffer).
constexpr int64_t kJointMaxBytes = int64_t{4} << 20;
bool travels_joint(const Header& first) { return payload_bytes(first) <= kJointMaxBytes; }

Header read_header(const at::Tensor& buffer) {
  Header h;
  std::memcpy(h.data(), buffer.data_ptr(), kHeaderBytes);
  return h;
}

}  // namespace

struct Communicator::P2PChannels {
  struct Channel {
    int64_t messages = 0;  // posted on this rank
    Header first{};        // this rank's header of the first: both ranks' once it is checked
  };
  std::map<std::tuple<int, int, bool>, Channel> by_key;  // (peer, tag, send)
};

Work Communicator::send(const at::Tensor& tensor, int dst, int tag) {
  return batch_p2p({P2POp{P2POp::kSend, tensor, dst, tag}});
}

Work Communicator::recv(const at::Tensor& tensor, int src, int tag) {
  return batch_p2p({P2POp{P2POp::kRecv, tensor, src, tag}});
}

Work Communicator::batch_p2p(std::vector<P2POp> ops) {
  const char* name = ops.size() != 1 ? "batch_p2p" : ops[0].kind == P2POp::kSend ? "send" : "recv";
  DTRAIN_CHECK_AS(CommError, !is_broken(), name, " on rank ", rank_,
                  ": this communicator is unusable after an earlier failure (", broken_reason(),
                  "). Restart the job; ranks cannot be brought back in step.");
  DTRAIN_CHECK_AS(CommError, !ops.empty(), name, ": no send or receive to run");
  std::vector<int> ranks{world_ranks_[static_cast<size_t>(rank_)]};
  int64_t numel = 0;
  for (P2POp& op : ops) {
    const char* role = op.kind == P2POp::kSend ? "send" : "recv";
    DTRAIN_CHECK_AS(CommError, op.peer >= 0 && op.peer < size_ && op.peer != rank_, name, ": ",
                    role, " peer ", op.peer,
                    " is not another rank of this communicator (ranks 0 to ", size_ - 1,
                    "; this one is ", rank_, ")");
    DTRAIN_CHECK_AS(CommError, op.tag >= 0 && op.tag <= kMaxTag, name, ": ", role, " tag ", op.tag,
                    " is outside [0, ", kMaxTag, "]");
    const at::Tensor& t = op.tensor;
    DTRAIN_CHECK_AS(CommError, t.defined(), name, ": the ", role, " tensor is undefined");
    DTRAIN_CHECK_AS(CommError, t.is_contiguous(), name, ": the ", role,
                    " tensor must be contiguous (sizes ", t.sizes(), ", strides ", t.strides(),
                    "); pass tensor.contiguous()");
    DTRAIN_CHECK_AS(CommError, t.dim() <= kMaxP2PDims, name, ": the ", role, " tensor has ",
                    t.dim(), " dimensions; point-to-point messages carry at most ", kMaxP2PDims);
    DTRAIN_CHECK_AS(CommError, device_type() != c10::kCUDA || t.is_cuda(), name, ": the ", role,
                    " tensor is on ", t.device(),
                    " but this communicator (nccl) needs CUDA tensors");
    op.world_peer = world_ranks_[static_cast<size_t>(op.peer)];
    if (std::find(ranks.begin(), ranks.end(), op.world_peer) == ranks.end()) {
      ranks.push_back(op.world_peer);
    }
    numel += t.numel();
  }
  CollectiveInfo info;
  info.op = name;
  const char* backend_name = backend_name_.load(std::memory_order_relaxed);
  if (backend_name == nullptr) {
    backend_name = interned_name(backend());
    backend_name_.store(backend_name, std::memory_order_relaxed);
  }
  info.backend = backend_name;
  info.rank = rank_;
  info.ranks = std::make_shared<const std::vector<int>>(std::move(ranks));
  info.dtype = ops[0].tensor.scalar_type();
  info.numel = numel;
  info.seq = next_p2p_++;
  info.comm_id = id_;
  if (trace::enabled()) info.label = trace::current_label();
  auto state = std::make_shared<detail::WorkState>(std::move(info), timeout_);
  state->on_break = on_break_;
  state->flight_ticket = flight::issued(state->info(), state->enqueued_ns());
  health_->track(state);
  Collective c{OpKind::kP2P, at::Tensor(),   at::Tensor(), ReduceOp::kSum, 0,
               state,        std::move(ops), p2p_channels_};
  enqueue(std::move(c));
  return Work(state);
}

void Communicator::run_p2p(const P2PPost& post, const Collective& c) {
  const size_t n = c.p2p.size();
  auto bytes_of = [](const at::Tensor& flat) {
    return flat.view(at::kByte);  // 1-D host tensor: its bytes, in place
  };
  // Each message's first transfer: its header alone (a channel's first message), or a header
  // and the channel's first number of bytes (`joint`).
  std::vector<at::Tensor> headers(n);
  std::vector<P2PWait> header_done(n);
  std::vector<char> joint(n, 0);
  std::vector<Header> first(n);     // joint: the channel's first header
  std::vector<at::Tensor> host(n);  // the bytes that travel: on the host (CUDA is staged)
  std::vector<P2PWait> data_done;
  std::vector<P2PWait> bytes_done(n);  // receives waited on threads of their own
  P2PChannels& channels = *c.channels;
  try {
    // Sends first, all of them: a receive below may wait for its channel's first message, and
    // the peer's sends never wait for this rank's.
    for (size_t i = 0; i < n; ++i) {
      const P2POp& op = c.p2p[i];
      if (op.kind != P2POp::kSend) continue;
      const Header h = header_of(op.tensor);
      auto& channel = channels.by_key[{op.peer, op.tag, true}];
      host[i] = to_host_flat(op.tensor);
      // A channel's first message: its header alone. A later one: one transfer of the header
      // and the first one's number of bytes, its own bytes there when its header is the
      // first's; another shape's header comes with zeros (the receiver accepts it only if its
      // own tensor changed alike), and its bytes follow as a first message's do.
      const bool first_message = channel.messages++ == 0;
      if (first_message) channel.first = h;
      const bool joint_channel = !first_message && travels_joint(channel.first);
      const bool bytes_joint = joint_channel && h == channel.first;
      const int64_t room = joint_channel ? payload_bytes(channel.first) : 0;
      headers[i] = at::empty({kHeaderBytes + room}, at::kByte);
      std::memcpy(headers[i].data_ptr(), h.data(), kHeaderBytes);
      if (room > 0) {
        at::Tensor rest = headers[i].narrow(0, kHeaderBytes, room);
        if (bytes_joint) {
          rest.copy_(bytes_of(host[i]));
        } else {
          rest.zero_();
        }
      }
      header_done[i] = post(true, headers[i], op.peer, transport_tag(op.tag, false));
      if (!bytes_joint && host[i].numel() > 0) {
        data_done.push_back(post(true, bytes_of(host[i]), op.peer, transport_tag(op.tag, true)));
      }
    }
    // A receive's header checked against its tensor; then its bytes are posted (a first
    // message, or a joint one whose shape changed on both sides), or copied out of the joint
    // transfer.
    auto checked = [&](size_t i) {
      const P2POp& op = c.p2p[i];
      const Header theirs = read_header(headers[i]);
      const Header mine = header_of(op.tensor);
      if (theirs != mine) {
        DTRAIN_FAIL(CommError, describe(c.state->info()), ": rank ", op.world_peer, " sent ",
                    header_text(theirs), " (tag ", op.tag, "), but rank ",
                    c.state->info().ranks->front(), " receives into ", header_text(mine),
                    ": a send and its receive must agree on dtype and shape (for a pipeline: "
                    "both stages' idea of the activation, micro-batch size included)");
      }
      host[i] = host_flat_like(op.tensor);
      if (joint[i] && mine == first[i]) {
        if (host[i].numel() > 0) {
          bytes_of(host[i]).copy_(headers[i].narrow(0, kHeaderBytes, payload_bytes(mine)));
        }
        return P2PWait{};
      }
      return host[i].numel() > 0
                 ? post(false, bytes_of(host[i]), op.peer, transport_tag(op.tag, true))
                 : P2PWait{};
    };
    // Receives in issue order. A later message's transfer is sized by its channel's first
    // header, which must be the sender's: where the first is in this batch, the later ones of
    // its channel are `deferred`, posted only once it is checked (a sender whose first differs
    // would otherwise send more than was posted), by the waits below. Every other receive is
    // posted here, before any wait, so that no peer's send waits for a receive this rank holds
    // back.
    std::map<std::pair<int, int>, size_t> first_here;  // (peer, tag): a first message's index
    std::vector<char> deferred(n, 0);
    auto post_header = [&](size_t i) {
      const P2POp& op = c.p2p[i];
      const int64_t room = joint[i] ? payload_bytes(first[i]) : 0;
      headers[i] = at::empty({kHeaderBytes + room}, at::kByte);
      header_done[i] = post(false, headers[i], op.peer, transport_tag(op.tag, false));
    };
    for (size_t i = 0; i < n; ++i) {
      const P2POp& op = c.p2p[i];
      if (op.kind != P2POp::kRecv) continue;
      auto& channel = channels.by_key[{op.peer, op.tag, false}];
      if (channel.messages++ == 0) {
        channel.first = header_of(op.tensor);
        first_here[{op.peer, op.tag}] = i;
      } else {
        joint[i] = travels_joint(channel.first) ? 1 : 0;
        first[i] = channel.first;
        if (first_here.count({op.peer, op.tag}) != 0) {
          deferred[i] = 1;
          continue;
        }
      }
      post_header(i);
    }
    std::vector<size_t> waiting;
    for (size_t i = 0; i < n; ++i) {
      if (c.p2p[i].kind == P2POp::kRecv) waiting.push_back(i);
    }
    // Receives from one peer under one tag match its messages in the order they are posted,
    // headers and payloads alike: a payload is posted only after those of the earlier
    // receives of its (peer, tag), or a later header that a poll found first would take an
    // earlier message's bytes.
    auto same_pair = [&](size_t a, size_t b) {
      return c.p2p[a].peer == c.p2p[b].peer && c.p2p[a].tag == c.p2p[b].tag;
    };
    // No bytes to post after a header: a joint message of the channel's first shape (a sender
    // whose shape changed is refused, not waited for). A deferred one's first is waiting too.
    const bool all_joint = std::all_of(waiting.begin(), waiting.end(), [&](size_t i) {
      return joint[i] != 0 && header_of(c.p2p[i].tensor) == first[i];
    });
    // waiting[0] is never deferred (its channel's first comes before it): its wait tells
    // whether the transport can be polled.
    if (!waiting.empty() && !header_done[waiting[0]].done && (waiting.size() == 1 || all_joint)) {
      // On a transport that cannot be polled (Gloo's works complete in wait()), one receive,
      // or receives whose transfers are all posted already (joint, of their channel's first
      // shape: nothing is posted after their headers, so no peer waits for this order):
      // waited here in order (a pipeline's usual batch; a thread costs more than its transfer).
      for (size_t i : waiting) {
        header_done[i].wait();
        header_done[i] = {};
        P2PWait bytes = checked(i);
        if (bytes) data_done.push_back(std::move(bytes));
      }
    } else if (!waiting.empty() && !header_done[waiting[0]].done) {
      // Several: a thread per receive waits for its header, and all are joined (those
      // started, should starting one fail).
      std::vector<std::exception_ptr> errors(n);
      std::vector<std::thread> threads;
      std::mutex order;
      std::condition_variable turn;
      std::vector<char> posted(n, 0);  // a receive's payload posted (or given up)
      std::vector<char> failed(n, 0);  // given up: its bytes, if any, were never received
      auto join_all = [&threads] {
        for (auto& th : threads) th.join();
      };
      try {
        for (size_t i : waiting) {
          threads.emplace_back([&, i] {
            auto mark = [&](bool failure) {
              std::lock_guard<std::mutex> lock(order);
              posted[i] = 1;
              failed[i] = failure ? 1 : 0;
              turn.notify_all();
            };
            try {
              if (!deferred[i]) {
                header_done[i].wait();
                header_done[i] = {};
              }
              {
                std::unique_lock<std::mutex> lock(order);
                turn.wait(lock, [&] {
                  for (size_t j : waiting) {
                    if (j < i && same_pair(j, i) && !posted[j]) return false;
                  }
                  return true;
                });
                // An earlier message of this peer and tag failed its check: its bytes may
                // still come first, so a payload posted now could take them.
                for (size_t j : waiting) {
                  DTRAIN_CHECK_AS(CommError, !(j < i && same_pair(j, i) && failed[j]),
                                  describe(c.state->info()), ": an earlier message from rank ",
                                  c.p2p[i].world_peer, " under tag ", c.p2p[i].tag,
                                  " in this batch failed, so this one was not received");
                }
              }
              if (deferred[i]) {  // its channel's first is checked: its size is the sender's
                post_header(i);
                header_done[i].wait();
                header_done[i] = {};
              }
              bytes_done[i] = checked(i);
              mark(false);
              if (bytes_done[i]) bytes_done[i].wait();
              bytes_done[i] = {};
            } catch (...) {
              errors[i] = std::current_exception();
              mark(true);
            }
          });
        }
      } catch (...) {
        join_all();
        throw;
      }
      join_all();
      for (auto& e : errors) {
        if (e) std::rethrow_exception(e);
      }
    } else {
      while (!waiting.empty()) {
        bool progressed = false;
        for (size_t k = 0; k < waiting.size();) {
          const size_t i = waiting[k];
          bool earlier = false;  // an earlier receive of this (peer, tag) still waits
          for (size_t e = 0; e < k; ++e) earlier = earlier || same_pair(waiting[e], i);
          if (!earlier && deferred[i]) {  // its channel's first is checked: post it now
            post_header(i);
            deferred[i] = 0;
            progressed = true;
          }
          if (earlier || !header_done[i].done()) {
            ++k;
            continue;
          }
          progressed = true;
          waiting.erase(waiting.begin() + static_cast<long>(k));
          header_done[i].wait();
          header_done[i] = {};
          P2PWait bytes = checked(i);
          if (bytes) data_done.push_back(std::move(bytes));
        }
        if (!progressed) {
          // The caller gave up (a timeout broke the communicator): stop polling, as the
          // worker may be shared with other communicators.
          DTRAIN_CHECK_AS(CommError, !c.state->is_completed(), describe(c.state->info()),
                          ": abandoned after it failed or timed out, a header still missing");
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
    }
    for (auto& done : data_done) {
      done.wait();
      done = {};
    }
    for (size_t i = 0; i < n; ++i) {
      if (c.p2p[i].kind == P2POp::kSend) {
        header_done[i].wait();
        header_done[i] = {};
      } else {
        copy_back(c.p2p[i].tensor, host[i]);
      }
    }
  } catch (...) {
    // The pair's messages are out of step (a payload left unreceived): the communicator
    // breaks, as after a timeout, and this op fails with its own error.
    // The communicator breaks before the op fails: a caller whose wait() throws finds it
    // broken already.
    try {
      throw;
    } catch (const std::exception& e) {
      c.state->notify_break(e.what());
    } catch (...) {
      c.state->notify_break("a point-to-point transfer failed");
    }
    c.state->fail(std::current_exception());
    // Transfers still posted hold their buffers (in their waits) for good: the backend may
    // still touch them, and this communicator is done.
    static std::mutex mu;
    static auto* kept = new std::vector<P2PWait>();
    std::lock_guard<std::mutex> lock(mu);
    for (auto& w : header_done) {
      if (w) kept->push_back(std::move(w));
    }
    for (auto& w : data_done) {
      if (w) kept->push_back(std::move(w));
    }
    for (auto& w : bytes_done) {
      if (w) kept->push_back(std::move(w));
    }
    throw;
  }
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
