#include "sharding/fsdp_unit.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>

#include "core/error.h"
#include "core/trace.h"
#include "sharding/flat.h"

namespace dtrain::sharding {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

FlatUnit::FlatUnit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params,
                   UnitGroups groups, const amp::MixedPrecisionPolicy& policy,
                   bool sync_module_states, BufferPool* pool, ShardLayout layout,
                   const ParamInit* init)
    : name_(std::move(name)),
      pool_(pool),
      groups_(std::move(groups)),
      policy_(policy),
      param_dtype_(policy.param_dtype),
      reduce_dtype_(policy.effective_reduce_dtype()) {
  DTRAIN_CHECK_AS(UsageError, !params.empty(), "FSDP unit '", name_, "' has no parameters");
  if (groups_.shard) {
    n_ = groups_.shard->size();
    rank_ = groups_.shard->rank();
  }
  replicas_ = groups_.replicate ? groups_.replicate->size() : 1;
  layout_ = n_ > 1 ? layout : ShardLayout::kFlat;  // one rank: the layouts are the same
  world_ = n_ * replicas_;
  // FSDP2's rule (_get_gradient_divide_factors): fp32 and bf16 gradients are summed, then
  // divided (ReduceOp.AVG: by the shard group after the reduce-scatter, by the replicas after
  // their all-reduce), rounding as fully_shard's does; fp16 takes DDP's pre/post split,
  // which neither overflows nor underflows.
  average_after_ = fsdp_averages_after(reduce_dtype_);
  if (!average_after_) {
    const DivideFactors f = divide_factors(world_, reduce_dtype_);
    pre_ = f.pre;
    post_ = f.post;
  }

  const c10::Device device = params.front().second.device();
  for (auto& [pname, t] : params) {
    DTRAIN_CHECK_AS(UsageError, t.device() == device, "FSDP unit '", name_, "': parameter '", pname,
                    "' is on ", t.device(), " but '", params.front().first, "' is on ", device,
                    "; move the module to one device before wrapping it");
    DTRAIN_CHECK_AS(UsageError, c10::isFloatingType(t.scalar_type()), "FSDP unit '", name_,
                    "': parameter '", pname, "' has dtype ", t.scalar_type(),
                    "; FSDP shards floating-point parameters only");
    DTRAIN_CHECK_AS(UsageError, init != nullptr || !is_placeholder(t), "FSDP unit '", name_,
                    "': parameter '", pname,
                    "' is a placeholder of a model built for deferred initialization; give "
                    "FSDPOptions::param_init, which fills it unit by unit");
    Param p;
    p.name = pname;
    p.module_param = t;
    p.shape = t.sizes().vec();
    p.trainable = t.requires_grad();
    frozen_ = frozen_ || !p.trainable;
    trainable_ += p.trainable ? 1 : 0;
    params_.push_back(std::move(p));
  }
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params_) shapes.push_back(p.shape);
  std::vector<ParamPlace> places;
  shard_size_ = place_params(layout_, shapes, n_, places);
  padded_ = shard_size_ * n_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    p.offset = places[i].offset;
    p.numel = places[i].numel;
    p.chunk = places[i].chunk;
    p.shard_at = places[i].shard_at;
    total_ += p.numel;
  }

  c10::NoGradGuard no_grad;
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  // Every rank starts from rank 0's values (as DDP does), then keeps its parts. Deferred
  // initialization writes them here, so the unit is whole only in this buffer.
  at::Tensor flat = at::empty({std::max<int64_t>(1, total_)}, fp32);
  for (const auto& p : params_) {
    at::Tensor slot = flat.narrow(0, p.offset, p.numel);
    if (init != nullptr) {
      at::Tensor full = slot.view(p.shape);
      (*init)(p.name, full);
      DTRAIN_CHECK_AS(UsageError, full.data_ptr() == slot.data_ptr(), "FSDP param_init for '",
                      p.name, "' replaced its tensor instead of filling it in place");
    } else {
      slot.copy_(p.module_param.detach().reshape({-1}));
    }
  }
  if (sync_module_states && groups_.world && groups_.world->size() > 1) {
    groups_.world->broadcast(flat, 0).wait();
  }
  shard_ = at::zeros({shard_size_}, fp32);
  for (auto& p : params_) {
    const Held h = held_by(layout_, p.place(), shard_size_, rank_);
    if (h.count > 0) {
      shard_.narrow(0, h.pos, h.count).copy_(flat.narrow(0, p.offset + h.begin, h.count));
    }
    p.master = flat_slot(shard_, h.pos, {h.count});
    p.master.requires_grad_(p.trainable);
    if (p.trainable && policy.keep_low_precision_grads && reduce_dtype_ != at::kFloat) {
      amp::note_low_precision_grads(p.master, reduce_dtype_);
    }
    p.master_begin = h.begin;
    p.master_at = h.pos;
  }
  flat = at::Tensor();

  const auto compute = at::TensorOptions().dtype(param_dtype_).device(device);
  empty_ = at::empty({0}, compute);
  if (n_ == 1 && param_dtype_ == at::kFloat) {
    full_ = shard_;  // NO_SHARD in fp32: the module's tensors view the masters themselves
  } else {
    full_ = at::empty({layout_ == ShardLayout::kFlat ? padded_ : total_}, compute);
    if (n_ > 1) free_storage(full_);
  }
  // From here on the module's tensors have param_dtype and are sharded. This is their one
  // dtype change: it drops their autograd accumulators, so hooks are registered after it.
  for (auto& p : params_) {
    p.module_param.mutable_grad().reset();
    p.module_param.set_data(empty_);
  }
  reported_.assign(params_.size(), false);
  filled_.assign(params_.size(), false);
  pending_ = trainable_;
}

std::unique_ptr<GradReadyHooks> FlatUnit::hook_gradients(GradReadyHooks::Callback on_ready) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> tensors;
  for (auto& p : params_) {
    // A full-shape placeholder over one element (a 0-dim tensor expanded, stride 0, so
    // 0-dim parameters work too): shape, dtype and device are what the accumulator records.
    p.module_param.set_data(at::empty({}, empty_.options()).expand(p.shape));
    tensors.push_back(p.module_param);
  }
  auto hooks = std::make_unique<GradReadyHooks>(tensors, std::move(on_ready));
  if (state_ == State::kUnsharded) {
    point_module_params_at_full();
  } else {
    for (auto& p : params_) p.module_param.set_data(empty_);
  }
  return hooks;
}

void FlatUnit::point_module_params_at_full() {
  c10::NoGradGuard no_grad;
  for (auto& p : params_) p.module_param.set_data(flat_slot(full_, p.offset, p.shape));
}

void FlatUnit::unshard() {
  c10::NoGradGuard no_grad;
  if (n_ == 1) {
    if (state_ == State::kUnsharded && !stale_) return;
    if (!full_.is_same(shard_)) full_.copy_(shard_);  // cast to param_dtype
    stale_ = false;
    state_ = State::kUnsharded;
    point_module_params_at_full();
    return;
  }
  if (state_ != State::kSharded) return;
  // flat: the gather writes the parameters' memory. per_parameter: a rank-major buffer whose
  // chunks wait_unsharded copies out; full_ gets its memory then, so a prefetched gather in
  // flight holds one copy of the unit, not two.
  if (layout_ == ShardLayout::kFlat) {
    alloc_storage(full_, pool_);
    gathered_ = full_;
  } else {
    gathered_ = buffer(padded_, full_.options());
  }
  // The all-gather input in param_dtype exists only while the gather runs (the collective
  // keeps it alive): a persistent copy would add param_dtype bytes / N to the steady state.
  at::Tensor input = param_dtype_ == at::kFloat ? shard_ : shard_.to(param_dtype_);
  std::optional<trace::Label> label;
  if (trace::enabled()) label.emplace("fsdp unit " + name_);
  gather_ = groups_.shard->all_gather(input, gathered_);
  works_.push_back(gather_);
  state_ = State::kGathering;
}

void FlatUnit::wait_unsharded(double* waited_s) {
  if (state_ == State::kSharded || (n_ == 1 && stale_)) unshard();
  if (state_ != State::kGathering) return;
  auto t0 = Clock::now();
  gather_.wait();
  if (waited_s != nullptr) *waited_s += since(t0);
  gather_ = comm::Work();
  if (layout_ == ShardLayout::kPerParameter) {
    c10::NoGradGuard no_grad;
    alloc_storage(full_, pool_);
    copy_out(gathered_, full_);
  }
  gathered_ = at::Tensor();
  state_ = State::kUnsharded;
  point_module_params_at_full();
}

at::Tensor FlatUnit::buffer(int64_t numel, const at::TensorOptions& options) const {
  return pool_ != nullptr ? pool_->empty(numel, options) : at::empty({numel}, options);
}

std::vector<std::pair<at::Tensor, at::Tensor>> FlatUnit::blocks(const Param& p,
                                                                const at::Tensor& param,
                                                                const at::Tensor& ranked) const {
  // An undefined `param` gives undefined first views (only the buffer's are wanted).
  auto part = [&](int64_t begin, int64_t count) {
    return param.defined() ? param.narrow(0, begin, count) : at::Tensor();
  };
  if (layout_ == ShardLayout::kFlat) {
    return {{part(0, p.numel), ranked.narrow(0, p.offset, p.numel)}};
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  if (p.chunk == 0) return out;
  // Ranks [0, k) hold whole chunks: one [k, chunk] block, strided by S in the buffer; rank
  // k holds the rest.
  const int64_t k = p.numel / p.chunk, rest = p.numel - k * p.chunk;
  if (k > 0) {
    at::Tensor whole = part(0, k * p.chunk);
    out.emplace_back(whole.defined() ? whole.view({k, p.chunk}) : whole,
                     ranked.view({n_, shard_size_}).narrow(0, 0, k).narrow(1, p.shard_at, p.chunk));
  }
  if (rest > 0) {
    out.emplace_back(part(k * p.chunk, rest), ranked.narrow(0, k * shard_size_ + p.shard_at, rest));
  }
  return out;
}

std::vector<at::Tensor> FlatUnit::padding(const at::Tensor& ranked) const {
  std::vector<at::Tensor> out;
  if (layout_ == ShardLayout::kFlat) {
    if (padded_ > total_) out.push_back(ranked.narrow(0, total_, padded_ - total_));
    return out;
  }
  const at::Tensor rows = ranked.view({n_, shard_size_});
  int64_t used = 0;
  for (const auto& p : params_) {
    used = std::max(used, p.shard_at + p.chunk);
    if (p.chunk == 0) continue;
    const int64_t k = p.numel / p.chunk, rest = p.numel - k * p.chunk;
    if (rest > 0)
      out.push_back(ranked.narrow(0, k * shard_size_ + p.shard_at + rest, p.chunk - rest));
    const int64_t empty_from = k + (rest > 0 ? 1 : 0);
    if (empty_from < n_) {
      out.push_back(rows.narrow(0, empty_from, n_ - empty_from).narrow(1, p.shard_at, p.chunk));
    }
  }
  if (used < shard_size_) out.push_back(rows.narrow(1, used, shard_size_ - used));
  return out;
}

void FlatUnit::copy_out(const at::Tensor& ranked, const at::Tensor& out) const {
  for (const auto& p : params_) {
    for (auto& [param, ranked_part] : blocks(p, out.narrow(0, p.offset, p.numel), ranked)) {
      param.copy_(ranked_part);
    }
  }
}

void FlatUnit::reshard() {
  if (n_ == 1) {
    stale_ = true;  // the optimizer may step the masters before the next forward
    return;
  }
  if (state_ == State::kSharded) return;
  if (state_ == State::kGathering) gather_.wait();  // never free what a collective writes
  gather_ = comm::Work();
  gathered_ = at::Tensor();
  c10::NoGradGuard no_grad;
  for (auto& p : params_) p.module_param.set_data(empty_);
  free_storage(full_);
  state_ = State::kSharded;
}

void FlatUnit::alloc_reduce_full() {
  reduce_full_ = buffer(padded_, at::TensorOptions().dtype(reduce_dtype_).device(shard_.device()));
  for (auto& pad : padding(reduce_full_)) pad.zero_();
}

bool FlatUnit::count_ready(int64_t i) {
  DTRAIN_CHECK_AS(UsageError, !reported_[i], "FSDP: parameter '", params_[i].name,
                  "' received its gradient twice in one backward. Run backward once per "
                  "forward (accumulate with no_sync()), and do not share a parameter between "
                  "reentrant checkpointed regions.");
  reported_[i] = true;
  return --pending_ == 0;
}

bool FlatUnit::take_module_grad(int64_t i) {
  Param& p = params_[i];
  at::Tensor& g = p.module_param.mutable_grad();
  if (!g.defined()) return false;
  c10::NoGradGuard no_grad;
  if (!reduce_full_.defined()) alloc_reduce_full();
  // Averaging, fused with the copy when no cast is needed (FSDP divides in the reduce
  // dtype, after the cast).
  for (auto& [src, slot] : blocks(p, g.reshape({-1}), reduce_full_)) {
    if (src.scalar_type() == reduce_dtype_ && pre_ != 1) {
      at::div_out(slot, src, at::scalar_tensor(pre_, src.options().device(at::kCPU)));
    } else {
      slot.copy_(src);
      if (pre_ != 1) slot.div_(pre_);
    }
  }
  g.reset();  // the unsharded gradient is no longer needed
  filled_[i] = true;
  return true;
}

bool FlatUnit::grad_ready(int64_t i) {
  const bool all = count_ready(i);
  take_module_grad(i);
  return all;
}

void FlatUnit::launch_reduce() {
  c10::NoGradGuard no_grad;
  if (!reduce_full_.defined()) alloc_reduce_full();
  // A parameter this backward gave no gradient (unused in it, or frozen) contributes what
  // earlier no_sync backwards accumulated on it, else zeros: nothing carries into the next
  // step.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (filled_[i] || (params_[i].trainable && take_module_grad(static_cast<int64_t>(i)))) {
      continue;
    }
    for (auto& block : blocks(params_[i], at::Tensor(), reduce_full_)) block.second.zero_();
  }
  std::optional<trace::Label> label;
  if (trace::enabled()) label.emplace("fsdp unit " + name_);
  if (n_ > 1) {
    reduce_shard_ = at::empty({shard_size_}, reduce_full_.options());
    reduce_ = (groups_.reduce ? groups_.reduce : groups_.shard)
                  ->reduce_scatter(reduce_full_, reduce_shard_);
    works_.push_back(reduce_);
    reduce_full_ = at::Tensor();  // the collective holds what it reads until it is done
  } else {
    reduce_shard_ = reduce_full_;
    reduce_full_ = at::Tensor();
    if (groups_.replicate) {
      reduce_ = groups_.replicate->all_reduce(reduce_shard_);
      works_.push_back(reduce_);
    }
  }
  reduce_launched_ = true;
}

bool FlatUnit::finish_scatter(double* waited_s) {
  if (!reduce_launched_ || scattered_) return reduce_launched_;
  auto t0 = Clock::now();
  reduce_.wait();
  if (waited_s != nullptr) *waited_s += since(t0);
  reduce_ = comm::Work();
  scattered_ = true;
  if (n_ > 1 && groups_.replicate) {
    // HYBRID_SHARD: the replicas of this shard average it next, on their own communicator,
    // while the backward and the next reduce-scatters go on; finish_reduce waits for it.
    c10::NoGradGuard no_grad;
    if (average_after_) reduce_shard_.div_(static_cast<double>(n_));
    replica_ = groups_.replicate->all_reduce(reduce_shard_);
    works_.push_back(replica_);
    replica_pending_ = true;
    return true;
  }
  return false;
}

void FlatUnit::finish_reduce(double* waited_s) {
  if (!reduce_launched_) return;
  finish_scatter(waited_s);
  c10::NoGradGuard no_grad;
  if (replica_pending_) {
    auto t0 = Clock::now();
    replica_.wait();
    if (waited_s != nullptr) *waited_s += since(t0);
    replica_ = comm::Work();
    replica_pending_ = false;
  } else if (average_after_ && n_ > 1) {
    reduce_shard_.div_(static_cast<double>(n_));
  }
  if (average_after_) {
    if (replicas_ > 1) reduce_shard_.div_(static_cast<double>(replicas_));
  } else if (post_ != 1) {
    reduce_shard_.div_(post_);
  }
  const c10::ScalarType target = policy_.keep_low_precision_grads ? reduce_dtype_ : at::kFloat;
  bool fresh = !grad_shard_.defined();
  for (const auto& p : params_) fresh = fresh || (p.trainable && !p.master.grad().defined());
  if (fresh) {
    grad_shard_ = reduce_shard_.scalar_type() == target ? reduce_shard_ : reduce_shard_.to(target);
    for (auto& p : params_) {
      if (p.trainable)
        p.master.mutable_grad() = flat_slot(grad_shard_, p.master_at, {p.master.numel()});
    }
  } else {
    grad_shard_.add_(reduce_shard_);  // a second backward before the optimizer step
  }
  reduce_shard_ = at::Tensor();
  reduce_launched_ = false;
  scattered_ = false;
}

void FlatUnit::begin_backward() {
  for (const auto& p : params_) {
    if (p.trainable && !p.master.grad().defined()) {
      grad_shard_ = at::Tensor();
      return;
    }
  }
}

void FlatUnit::reset_backward() {
  std::fill(reported_.begin(), reported_.end(), false);
  std::fill(filled_.begin(), filled_.end(), false);
  pending_ = trainable_;
  if (!reduce_launched_) reduce_full_ = at::Tensor();
}

void FlatUnit::drop_grads() {
  for (auto& p : params_) {
    if (p.trainable) p.master.mutable_grad().reset();
  }
  grad_shard_ = at::Tensor();
}

at::Tensor FlatUnit::gather(const at::Tensor& flat) const {
  c10::NoGradGuard no_grad;
  if (n_ == 1) return flat.narrow(0, 0, total_).clone();
  at::Tensor ranked = at::empty({padded_}, flat.options());
  groups_.shard->all_gather(flat.contiguous(), ranked).wait();
  if (layout_ == ShardLayout::kFlat) return ranked.narrow(0, 0, total_);
  at::Tensor full = at::empty({total_}, flat.options());
  copy_out(ranked, full);
  return full;
}

at::Tensor FlatUnit::flat_of(const std::vector<at::Tensor>& parts, at::Tensor into) const {
  c10::NoGradGuard no_grad;
  const bool reuse = into.defined() && into.numel() == shard_size_ && into.dim() == 1 &&
                     into.scalar_type() == shard_.scalar_type() &&
                     into.device() == shard_.device() && into.is_contiguous();
  at::Tensor flat = reuse ? into : at::zeros({shard_size_}, shard_.options());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    if (p.master.numel() == 0) continue;
    at::Tensor slot = flat.narrow(0, p.master_at, p.master.numel());
    if (parts[i].defined()) {
      slot.copy_(parts[i].reshape({-1}));
    } else if (reuse) {
      slot.zero_();
    }
  }
  return flat;
}

std::vector<comm::Work> FlatUnit::take_works() {
  std::vector<comm::Work> out;
  out.swap(works_);
  return out;
}

}  // namespace dtrain::sharding
