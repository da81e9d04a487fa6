#include "sharding/reducer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_set>

#include "amp/grad_scaler.h"
#include "amp/numerics.h"
#include "comm/types.h"
#include "core/error.h"
#include "core/logging.h"
#include "core/trace.h"
#include "sharding/deferred_init.h"
#include "sharding/flat.h"
#include "sharding/widen.h"

namespace dtrain::sharding {

static_assert(std::is_same_v<amp::GradScaler::Ticket, uint64_t>,
              "reducer.h keeps the scaler's tickets as uint64_t");

namespace {

using Clock = std::chrono::steady_clock;

// Buckets and broadcasts never mix dtypes or devices.
std::string group_key(const at::Tensor& t) {
  return t.device().str() + "/" + c10::toString(t.scalar_type());
}

std::string shape_string(const std::vector<int64_t>& sig, size_t& at) {
  int64_t ndim = sig[at++];
  std::ostringstream os;
  os << "[";
  for (int64_t d = 0; d < ndim; ++d) os << (d ? ", " : "") << sig[at++];
  os << "] " << comm::dtype_name(static_cast<c10::ScalarType>(sig[at++]));
  os << (sig[at++] ? "" : " (frozen)");
  return os.str();
}

}  // namespace

Reducer::Reducer(NamedTensors params, NamedTensors buffers,
                 std::shared_ptr<comm::Communicator> comm, DDPOptions options)
    : params_(std::move(params)),
      buffers_(std::move(buffers)),
      comm_(std::move(comm)),
      options_(options) {
  DTRAIN_CHECK_AS(UsageError, comm_ != nullptr, "DDP needs a communicator");
  check_no_placeholders(params_, "DDP");
  DTRAIN_CHECK_AS(UsageError, options_.bucket_cap_mb() > 0, "DDP: bucket_cap_mb must be > 0, got ",
                  options_.bucket_cap_mb());
  DTRAIN_CHECK_AS(UsageError, options_.first_bucket_mb() > 0,
                  "DDP: first_bucket_mb must be > 0, got ", options_.first_bucket_mb());
  if (options_.reduce_dtype()) {
    DTRAIN_CHECK_AS(UsageError, c10::isFloatingType(*options_.reduce_dtype()),
                    "DDP: reduce_dtype must be a floating dtype, got ", *options_.reduce_dtype());
  }
  verify_same_parameters();
  sync_module_states();
  std::vector<int64_t> order;
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i) {
    if (params_[i].second.requires_grad()) order.push_back(i);
  }
  DTRAIN_CHECK_AS(UsageError, !order.empty(),
                  "DDP: the module has no parameter that requires grad; there is nothing to "
                  "synchronize");
  where_.assign(params_.size(), Location{});
  ready_.assign(params_.size(), false);
  local_used_ = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
  build_buckets(order, /*rebuilt=*/false);
  std::vector<at::Tensor> tensors;
  for (const auto& [name, p] : params_) tensors.push_back(p);
  hooks_ = std::make_unique<GradReadyHooks>(tensors, [this](int64_t i) { autograd_hook(i); });
}

Reducer::~Reducer() {
  drain_in_flight();
  hooks_.reset();  // before the buckets the hooks write to
}

// Every rank must hold the same parameters, in the same order, with the same shapes.
void Reducer::verify_same_parameters() {
  std::vector<int64_t> sig{static_cast<int64_t>(params_.size())};
  for (const auto& [name, p] : params_) {
    sig.push_back(p.dim());
    for (int64_t s : p.sizes()) sig.push_back(s);
    sig.push_back(static_cast<int64_t>(p.scalar_type()));
    sig.push_back(p.requires_grad() ? 1 : 0);
  }
  const int world = comm_->size();
  // The reducer's own collectives run on the communicator's device (NCCL: this rank's GPU).
  const auto on_comm = at::TensorOptions().dtype(at::kLong).device(comm_->device());
  at::Tensor len = at::full({1}, static_cast<int64_t>(sig.size()), on_comm);
  comm_->all_reduce(len, comm::ReduceOp::kMax).wait();
  const int64_t width = len.item<int64_t>();
  at::Tensor mine = at::full({width}, -1, at::kLong);
  std::copy(sig.begin(), sig.end(), mine.data_ptr<int64_t>());
  at::Tensor all = at::empty({world * width}, on_comm);
  comm_->all_gather(mine.to(comm_->device()), all).wait();
  all = all.cpu();
  const int64_t* base = all.data_ptr<int64_t>();
  std::vector<int64_t> ref(base, base + width);  // rank 0's
  for (int r = 1; r < world; ++r) {
    std::vector<int64_t> other(base + r * width, base + (r + 1) * width);
    if (other == ref) continue;
    size_t a = 1, b = 1;
    for (int64_t i = 0; i < std::min(ref[0], other[0]); ++i) {
      std::string s0 = shape_string(ref, a), sr = shape_string(other, b);
      std::string here = i < static_cast<int64_t>(params_.size())
                             ? " ('" + params_[i].first + "' on this rank)"
                             : std::string();
      DTRAIN_CHECK_AS(UsageError, s0 == sr, "DDP: parameter #", i, here, " is ", sr, " on rank ", r,
                      " but ", s0, " on rank 0. Every rank must build the same model.");
    }
    DTRAIN_FAIL(UsageError, "DDP: rank ", r, " has ", other[0], " parameters but rank 0 has ",
                ref[0], ". Every rank must build the same model.");
  }
}

void Reducer::broadcast_flat(const std::vector<at::Tensor>& tensors) {
  if (comm_->size() == 1 || tensors.empty()) return;
  c10::NoGradGuard no_grad;
  // One broadcast per dtype/device, in first-seen order (identical on every rank).
  std::vector<std::pair<std::string, std::vector<at::Tensor>>> groups;
  for (const auto& t : tensors) {
    std::string key = group_key(t);
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == key; });
    if (it == groups.end()) {
      groups.push_back({key, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(t);
  }
  for (auto& [key, group] : groups) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : group) flat_parts.push_back(t.detach().reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    comm_->broadcast(flat, 0).wait();
    int64_t off = 0;
    for (auto& t : group) {
      t.detach().copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

void Reducer::sync_module_states() {
  std::vector<at::Tensor> tensors;
  for (const auto& [name, p] : params_) tensors.push_back(p);
  // Buffers too only with broadcast_buffers, as PyTorch's constructor (init_sync_buffers).
  if (options_.broadcast_buffers()) {
    for (const auto& [name, b] : buffers_) tensors.push_back(b);
  }
  broadcast_flat(tensors);
}

std::vector<std::vector<int64_t>> Reducer::assign_buckets(const std::vector<int64_t>& order,
                                                          const std::vector<double>& limits,
                                                          bool sort_by_first_index) const {
  // PyTorch's compute_bucket_assignment_by_size: greedy over `order`, per dtype/device; a
  // bucket closes once it reaches its limit, limits[k] for a group's k-th bucket (the last
  // limit repeating). Buckets still open at the end follow, in group order.
  struct Open {
    std::vector<int64_t> params;
    double bytes = 0;
    size_t limit = 0;
  };
  std::map<std::string, Open> open;
  std::vector<std::vector<int64_t>> assignment;
  for (int64_t i : order) {
    const at::Tensor& p = params_[i].second;
    Open& o = open[group_key(p)];
    o.params.push_back(i);
    o.bytes += static_cast<double>(p.numel() * static_cast<int64_t>(p.element_size()));
    if (o.bytes >= limits[o.limit]) {
      assignment.push_back(std::move(o.params));
      o.params.clear();
      o.bytes = 0;
      o.limit = std::min(o.limit + 1, limits.size() - 1);
    }
  }
  for (auto& [key, o] : open) {
    if (!o.params.empty()) assignment.push_back(std::move(o.params));
  }
  if (sort_by_first_index) {
    std::sort(assignment.begin(), assignment.end(),
              [](const auto& a, const auto& b) { return a.front() < b.front(); });
  }
  return assignment;
}

void Reducer::build_buckets(const std::vector<int64_t>& order, bool rebuilt) {
  c10::NoGradGuard no_grad;
  const double mb = 1024.0 * 1024.0;
  const int64_t world = comm_->size();
  const double first_cap = options_.first_bucket_mb() * mb, cap = options_.bucket_cap_mb() * mb;
  // PyTorch's layout, bucket for bucket, so that the sums (c10d Gloo's all-reduce adds each
  // element in an order set by its place in the bucket) are PyTorch's at any world size.
  std::vector<std::vector<int64_t>> assignment;
  if (!rebuilt) {
    // Before the first iteration: the parameters in registration order, grouped by size only
    // when unused parameters are searched for (otherwise one bucket per dtype/device), and the
    // buckets launched last-registered first.
    const std::vector<double> limits =
        options_.find_unused_parameters()
            ? (first_cap < cap ? std::vector<double>{first_cap, cap} : std::vector<double>{cap})
            : std::vector<double>{std::numeric_limits<double>::infinity()};
    assignment = assign_buckets(order, limits, /*sort_by_first_index=*/true);
    std::reverse(assignment.begin(), assignment.end());
  } else if (!options_.small_last_bucket()) {
    // In arrival order, the first bucket small so that communication starts early.
    assignment = assign_buckets(order, {first_cap, cap}, false);
  } else {
    // The last bucket small instead (PyTorch's DDP_SET_LAST_BUCKET_CAP=1): it holds the
    // gradients that arrive last, whose all-reduce nothing is left to overlap.
    std::vector<int64_t> reversed(order.rbegin(), order.rend());
    assignment = assign_buckets(reversed, {first_cap, cap}, false);
    std::reverse(assignment.begin(), assignment.end());
  }

  std::vector<Bucket> buckets;
  for (size_t bi = 0; bi < assignment.size(); ++bi) {
    Bucket b;
    b.params = assignment[bi];
    const at::Tensor& first = params_[b.params.front()].second;
    int64_t total = 0;
    for (int64_t i : b.params) {
      b.offsets.push_back(total);
      total += params_[i].second.numel();
    }
    b.contents = at::zeros({total}, first.options());
    c10::ScalarType reduce = options_.reduce_dtype().value_or(first.scalar_type());
    b.comm_buffer = reduce == first.scalar_type()
                        ? b.contents
                        : at::empty({total}, first.options().dtype(reduce));
    for (size_t s = 0; s < b.params.size(); ++s) {
      at::Tensor& p = params_[b.params[s]].second;
      at::Tensor view = p.is_contiguous()
                            ? flat_slot(b.contents, b.offsets[s], p.sizes())
                            : flat_slot(b.contents, b.offsets[s], p.sizes(), p.strides());
      b.views.push_back(view);
      where_[b.params[s]] = Location{static_cast<int64_t>(bi), static_cast<int64_t>(s)};
      // Keep accumulated gradients (a rebuild between accumulation steps).
      at::Tensor& grad = p.mutable_grad();
      if (grad.defined()) {
        view.copy_(grad);
        if (options_.gradient_as_bucket_view()) grad = view;
      }
    }
    const c10::ScalarType comm = b.comm_buffer.scalar_type();
    if (!b.comm_buffer.is_same(b.contents) && (comm == at::kBFloat16 || comm == at::kHalf) &&
        (world & (world - 1)) != 0) {
      b.cast_divide = static_cast<double>(world);  // the compress hooks' order (reducer.h)
    } else {
      b.divide = divide_factors(world, comm);
    }
    b.pending = static_cast<int64_t>(b.params.size());
    buckets.push_back(std::move(b));
  }
  buckets_ = std::move(buckets);
  std::ostringstream os;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const Bucket& b = buckets_[bi];
    os << (bi ? ", " : "") << b.params.size() << " params/"
       << logging::fixed(b.contents.numel() * b.contents.element_size() / mb, 2) << " MB in "
       << comm::dtype_name(b.comm_buffer.scalar_type()) << ", divided by " << b.divide.pre
       << " before";
    if (b.cast_divide != 1) os << " and " << b.cast_divide << " after the cast";
    os << " and " << b.divide.post << " after";
  }
  logging::debug("DDP: ", buckets_.size(), " buckets (", os.str(), ")");
}

void Reducer::autograd_hook(int64_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  // Used only if it holds a gradient, as PyTorch's autograd_hook: the hook also fires for an
  // undefined one (a custom Function's, or recompute's for a parameter its region skipped), and
  // a parameter no rank used must keep none, so that the optimizer leaves it alone.
  if (options_.find_unused_parameters() && params_[index].second.grad().defined()) {
    local_used_.data_ptr<int>()[index] = 1;
  }
  if (!expect_hooks_) return;  // no_sync, or a forward that did not go through DDP
  if (!callback_queued_) {
    callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
  }
  if (!marked_unused_) {
    marked_unused_ = true;
    for (int64_t u : unused_) mark_ready(u, /*from_hook=*/false);
  }
  mark_ready(index, /*from_hook=*/true);
}

void Reducer::mark_ready(int64_t index, bool from_hook) {
  const std::string& name = params_[index].first;
  DTRAIN_CHECK_AS(UsageError, !ready_[index], "DDP: parameter '", name,
                  "' received its gradient twice in one iteration. Run backward once per DDP "
                  "forward (wrap extra backward passes in no_sync()), and do not share a "
                  "parameter between reentrant checkpointed regions.");
  ready_[index] = true;
  if (from_hook && !rebuilt_) ready_order_.push_back(index);
  const Location loc = where_[index];
  Bucket& b = buckets_[loc.bucket];
  at::Tensor& view = b.views[loc.slot];
  at::Tensor& grad = params_[index].second.mutable_grad();
  c10::NoGradGuard no_grad;
  // Averaging happens here, fused with the copy into the bucket (one pass, as PyTorch's
  // mul_out), so launching a bucket needs no extra pass over it.
  if (grad.defined()) {
    if (!grad.is_alias_of(view)) {
      if (b.divide.pre != 1) {
        at::mul_out(view, grad,
                    at::scalar_tensor(1.0 / b.divide.pre, grad.options().device(c10::kCPU)));
      } else {
        view.copy_(grad);
      }
      if (options_.gradient_as_bucket_view()) grad = view;
    } else if (b.divide.pre != 1) {
      view.div_(b.divide.pre);
    }
  } else {
    view.zero_();  // unused here: contributes nothing to the average
  }
  if (--b.pending == 0) launch_ready_buckets();
}

void Reducer::launch_ready_buckets() {
  // Strictly in bucket order, so every rank issues the same collectives in the same order.
  while (next_bucket_ < static_cast<int64_t>(buckets_.size()) &&
         buckets_[next_bucket_].pending == 0) {
    Bucket& b = buckets_[next_bucket_++];
    if (!b.comm_buffer.is_same(b.contents)) b.comm_buffer.copy_(b.contents);
    if (b.cast_divide != 1) b.comm_buffer.div_(b.cast_divide);
    std::optional<trace::Label> label;
    if (trace::enabled()) label.emplace("ddp bucket " + std::to_string(next_bucket_ - 1));
    b.work = comm_->all_reduce(b.comm_buffer, comm::ReduceOp::kSum);
    b.launched = true;
  }
}

void Reducer::finalize_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  callback_queued_ = false;
  c10::NoGradGuard no_grad;
  ReducerStats stats;
  stats_works_.clear();
  auto t0 = Clock::now();
  for (auto& b : buckets_) {
    if (b.launched && !b.finished) b.work.wait();
  }
  stats.exposed_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  at::Tensor global_used;
  if (options_.find_unused_parameters()) {
    // Hooks write local_used_ on the host; the MAX runs on the communicator's device.
    global_used = local_used_.to(comm_->device(), /*non_blocking=*/false, /*copy=*/true);
    comm_->all_reduce(global_used, comm::ReduceOp::kMax).wait();
    global_used = global_used.cpu();
    local_used_.zero_();
  }
  bool all_done = true;
  bool found_inf = false;
  // With a grad_scaler whose scale allows it exactly, every CPU fp32 bucket is unscaled as it
  // is written back, and each gradient's verdict handed to the scaler.
  float scale = 0;  // 0: leave the gradients scaled
  if (amp::GradScaler* scaler = options_.grad_scaler()) {
    scale = scaler->exact_unscale_divisor().value_or(0.0f);
    for (const auto& b : buckets_) {
      if (!b.contents.is_cpu() || b.contents.scalar_type() != at::kFloat) scale = 0;
    }
  }
  std::vector<at::Tensor> unscaled;
  std::vector<bool> unscaled_found, slot_found;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    if (!b.launched) {
      all_done = false;
      continue;
    }
    if (b.finished) continue;
    const auto w0 = Clock::now();
    found_inf = write_back(b, scale != 0 ? 1.0f / scale : 1.0f, scale != 0 ? &slot_found : nullptr,
                           &stats.finite_check_seconds) ||
                found_inf;
    stats.write_back_seconds += std::chrono::duration<double>(Clock::now() - w0).count();
    for (size_t s = 0; s < b.params.size(); ++s) {
      at::Tensor& p = params_[b.params[s]].second;
      at::Tensor& grad = p.mutable_grad();
      const bool globally_used =
          !global_used.defined() || global_used.data_ptr<int>()[b.params[s]] != 0;
      if (!grad.defined()) {
        // Unused on this rank: takes the others' average, unless nobody used it (then it
        // keeps no gradient, as in PyTorch, so the optimizer leaves it alone).
        if (globally_used) {
          grad = options_.gradient_as_bucket_view() ? b.views[s] : b.views[s].clone();
        }
      } else if (!grad.is_alias_of(b.views[s]) && globally_used) {
        grad.copy_(b.views[s]);  // a parameter nobody used keeps its gradient, as PyTorch's
      }
      if (scale != 0 && grad.defined()) {
        unscaled.push_back(grad);
        unscaled_found.push_back(slot_found[s]);
      }
    }
    if (options_.monitor() != nullptr) {
      options_.monitor()->record("ddp.bucket" + std::to_string(bi) + ".grad", b.contents);
    }
    stats_works_.push_back(b.work);
    ++stats.buckets;
    b.finished = true;
  }
  stats_ = stats;
  if (scale != 0 && !unscaled.empty()) {
    unscaled_tickets_.push_back(options_.grad_scaler()->accept_unscaled(
        {std::move(unscaled), scale, std::move(unscaled_found)}));
  }
  if (options_.check_finite()) {
    if (!found_inf_.defined()) found_inf_ = at::zeros({1}, at::kFloat);
    found_inf_.fill_(found_inf ? 1.0 : 0.0);
  }
  if (all_done) {
    expect_hooks_ = false;
    unfinished_ = false;
    if (options_.rebuild_buckets() && !options_.find_unused_parameters() && !rebuilt_) {
      rebuild_due_ = true;
    }
  } else {
    unfinished_ = true;  // reported by the next forward (another backward may still come)
  }
}

bool Reducer::write_back(Bucket& b, float multiply, std::vector<bool>* found_per_slot,
                         double* check_seconds) {
  const bool check = options_.check_finite() || found_per_slot != nullptr;
  const c10::ScalarType from = b.comm_buffer.scalar_type();
  const bool widen = from == at::kBFloat16 || from == at::kHalf;
  if (b.comm_buffer.is_cpu() && b.contents.scalar_type() == at::kFloat &&
      (widen || (check && from == at::kFloat))) {
    // One pass per parameter: widen, divide, check, unscale (sharding/widen.h). As fast as
    // ATen's copy_ alone (memory-bound: 6 ms per 19M bf16 values on one core here), so 16-bit
    // buckets take it with or without a check. The bucket's parameters tile it, so this
    // writes every element.
    if (found_per_slot != nullptr) found_per_slot->assign(b.params.size(), false);
    const auto* src = static_cast<const char*>(b.comm_buffer.data_ptr());
    const int64_t esize = static_cast<int64_t>(b.comm_buffer.element_size());
    float* dst = b.contents.data_ptr<float>();
    bool found = false;
    const float post = static_cast<float>(b.divide.post);
    for (size_t s = 0; s < b.params.size(); ++s) {
      const int64_t off = b.offsets[s];
      // Over ATen's intra-op threads, as copy_ would be (one range below the grain size).
      std::atomic<bool> f{false};
      at::parallel_for(0, params_[b.params[s]].second.numel(), 1 << 16,
                       [&](int64_t begin, int64_t end) {
                         if (widen_checked(src + (off + begin) * esize, from, dst + off + begin,
                                           end - begin, post, multiply)) {
                           f.store(true, std::memory_order_relaxed);
                         }
                       });
      if (found_per_slot != nullptr) (*found_per_slot)[s] = f.load();
      found = found || f.load();
    }
    return check && found;
  }
  // Any other bucket (a GPU one, fp64): ATen's copy and division, then the check's own pass.
  if (!b.comm_buffer.is_same(b.contents)) b.contents.copy_(b.comm_buffer);
  if (b.divide.post != 1) b.contents.div_(b.divide.post);
  DTRAIN_CHECK(found_per_slot == nullptr && multiply == 1.0f,
               "DDP: unscaling in the write-back needs CPU fp32 buckets");
  if (!check) return false;
  const auto t0 = Clock::now();
  const bool found = !at::isfinite(b.contents).all().item<bool>();
  *check_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  return found;
}

void Reducer::drain_in_flight() noexcept {
  for (auto& b : buckets_) {
    if (!b.launched || b.finished) continue;
    try {
      b.work.wait();
    } catch (const PeerLostError&) {
      // A peer is gone, or a wait timed out: the error that ends the step says so once.
    } catch (const TimeoutError&) {
    } catch (const std::exception& e) {
      logging::warn("DDP: a gradient all-reduce left behind by an aborted backward failed: ",
                    e.what());
    }
    b.finished = true;
  }
}

void Reducer::reset_iteration() {
  drain_in_flight();
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& b : buckets_) {
    b.pending = static_cast<int64_t>(b.params.size());
    b.launched = false;
    b.finished = false;
    b.work = comm::Work();
  }
  next_bucket_ = 0;
  marked_unused_ = false;
  callback_queued_ = false;
  unused_.clear();
}

std::vector<int64_t> Reducer::find_unused(const std::vector<at::Tensor>& outputs) const {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  std::vector<int64_t> unused;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (hooks_->hooked(i) && seen.count(hooks_->node(i)) == 0) {
      unused.push_back(static_cast<int64_t>(i));
    }
  }
  return unused;
}

void Reducer::rebuild_buckets() {
  // Rank 0's arrival order, so every rank builds identical buckets.
  std::vector<int64_t> order = ready_order_;
  std::vector<bool> seen(params_.size(), false);
  for (int64_t i : order) seen[i] = true;
  for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
    if (!seen[i] && params_[i].second.requires_grad()) order.push_back(i);
  }
  at::Tensor t = at::tensor(order, at::kLong).to(comm_->device());
  comm_->broadcast(t, 0).wait();
  t = t.cpu();
  std::vector<int64_t> agreed(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  if (logging::enabled(logging::Level::kDebug)) {
    std::ostringstream os;
    for (int64_t i : agreed) os << ' ' << i;
    logging::debug("DDP: buckets rebuilt in rank 0's gradient order (parameter indices):",
                   os.str());
  }
  build_buckets(agreed, /*rebuilt=*/true);
  rebuilt_order_ = agreed;
  rebuilt_ = true;
  rebuild_due_ = false;
  ready_order_.clear();
}

void Reducer::prepare_for_forward(bool will_sync) {
  std::lock_guard<std::mutex> lock(mu_);
  // Gradients the last backward unscaled that no optimizer stepped with: scaled again, so
  // this iteration's backward accumulates onto values of its own scale.
  if (options_.grad_scaler() != nullptr) {
    for (uint64_t t : unscaled_tickets_) options_.grad_scaler()->withdraw(t);
  }
  unscaled_tickets_.clear();
  // Checked where PyTorch checks it (ensure_prior_reduction_finished, from _rebuild_buckets):
  // in a forward with gradients enabled; a no_grad forward in between says nothing.
  if (unfinished_ && c10::GradMode::is_enabled()) {
    std::ostringstream names;
    int64_t count = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!hooks_->hooked(i) || ready_[i]) continue;
      if (count < 10) names << (count ? ", " : "") << params_[i].first;
      ++count;
    }
    DTRAIN_FAIL(UsageError, "DDP: the previous iteration's backward produced no gradient for ",
                count, " parameter(s): ", names.str(), count > 10 ? ", ..." : "",
                ". They did not take part in computing the loss, so their gradients were never "
                "reduced. Construct DDP with find_unused_parameters(true) (config: "
                "parallel.find_unused_parameters: true), or make every parameter contribute "
                "to the loss.");
  }
  // As PyTorch's DDP: in the first forward with gradients enabled after the first
  // synchronizing backward, under no_sync too (every rank runs the same forwards). Gradients
  // accumulated before a rebuild are copied into the new buckets and averaged in place (div_),
  // not while being copied (mul by 1/world): at 3 ranks the two round apart.
  if (rebuild_due_ && c10::GradMode::is_enabled()) {
    drain_in_flight();
    rebuild_buckets();
  }
  // As PyTorch's DDP (require_forward_param_sync): buffers come from rank 0 only in a forward
  // that follows a synchronizing one (or the first), so a step accumulating under no_sync
  // takes them once, and a rank's buffers then go their own way until the next sync.
  if (options_.broadcast_buffers() && !buffers_.empty() && buffers_due_) {
    std::vector<at::Tensor> b;
    for (const auto& [name, t] : buffers_) b.push_back(t);
    broadcast_flat(b);
  }
  buffers_due_ = will_sync;
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  reset_iteration();
  if (!rebuilt_) ready_order_.clear();
  expect_hooks_ = true;
  if (options_.find_unused_parameters()) {
    DTRAIN_CHECK_AS(UsageError, !outputs.empty(),
                    "DDP: find_unused_parameters needs the forward's output tensors; return "
                    "at::Tensor, std::vector<at::Tensor> or a std::tuple of tensors from "
                    "forward()");
    unused_ = find_unused(outputs);
  }
}

const ReducerStats& Reducer::last_stats() const {
  for (const auto& w : stats_works_) {
    w.synchronize();
    stats_.comm_seconds += w.busy_seconds();
  }
  stats_works_.clear();
  return stats_;
}

void Reducer::restore_rebuilt_order(const std::vector<int64_t>& order) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!options_.rebuild_buckets() || options_.find_unused_parameters() || order.empty()) return;
  std::vector<bool> seen(params_.size(), false);
  size_t wanted = 0;
  for (const auto& [name, p] : params_) wanted += p.requires_grad() ? 1 : 0;
  bool fits = order.size() == wanted;
  for (int64_t i : order) {
    fits = fits && i >= 0 && i < static_cast<int64_t>(params_.size()) && !seen[i] &&
           params_[i].second.requires_grad();
    if (fits) seen[i] = true;
  }
  if (!fits) {
    logging::debug("DDP: the saved bucket order does not fit this model; buckets kept");
    return;
  }
  drain_in_flight();
  build_buckets(order, /*rebuilt=*/true);
  rebuilt_order_ = order;
  rebuilt_ = true;
  rebuild_due_ = false;
  ready_order_.clear();
}

std::vector<std::vector<int64_t>> Reducer::bucket_indices() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& b : buckets_) out.push_back(b.params);
  return out;
}

}  // namespace dtrain::sharding
