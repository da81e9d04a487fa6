#include "sharding/fsdp_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <optional>

#include "amp/numerics.h"
#include "comm/types.h"
#include "core/error.h"
#include "core/logging.h"
#include "core/trace.h"

namespace dtrain::sharding {

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  const std::optional<ShardingStrategy> s = choice_from_name<ShardingStrategy>(name);
  DTRAIN_CHECK_AS(ConfigError, s.has_value(), "unknown sharding strategy '", name,
                  "'; expected one of ", choice_list<ShardingStrategy>());
  return *s;
}

const char* to_string(ShardingStrategy s) { return name_of(s); }

namespace {

// The shard and replicate groups of a strategy (null where a group would be one rank).
UnitGroups make_groups(const std::shared_ptr<comm::Communicator>& world,
                       const FSDPOptions& options) {
  UnitGroups g;
  g.world = world;
  const int size = world->size(), rank = world->rank();
  switch (options.sharding_strategy()) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      if (size > 1) g.shard = world;
      break;
    case ShardingStrategy::kNoShard:
      if (size > 1) g.replicate = world;
      break;
    case ShardingStrategy::kHybridShard: {
      // Shard within a node, replicate across nodes: by default the nodes the rendezvous
      // learned (comm/rendezvous.h), else blocks of hybrid_group_size consecutive ranks.
      int64_t group = options.hybrid_group_size();
      int shard_color = 0, replicate_color = 0;
      const auto& nodes = world->world_nodes();
      if (group == 0 && !nodes.empty()) {
        std::map<int, std::vector<int>> members;  // node -> ranks of `world` there
        for (int r = 0; r < size; ++r) members[nodes[world->world_ranks()[r]]].push_back(r);
        const int mine = nodes[world->world_ranks()[rank]];
        std::string counts;
        bool even = true;
        for (const auto& [node, ranks] : members) {
          counts += (counts.empty() ? "" : ", ") + std::to_string(ranks.size());
          even = even && ranks.size() == members.begin()->second.size();
        }
        DTRAIN_CHECK_AS(ConfigError, even, "FSDP hybrid_shard shards within each node, but the ",
                        members.size(), " nodes hold different numbers of ranks (", counts,
                        "); start the same number on every node, or set "
                        "parallel.hybrid_group_size");
        const auto& here = members[mine];
        shard_color = mine;
        replicate_color =
            static_cast<int>(std::find(here.begin(), here.end(), rank) - here.begin());
      } else {
        if (group == 0) {
          const char* local = std::getenv("LOCAL_WORLD_SIZE");
          if (local == nullptr) local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
          group = local != nullptr ? std::atoll(local) : size;
        }
        DTRAIN_CHECK_AS(ConfigError, group >= 1 && size % group == 0,
                        "FSDP hybrid_shard: the shard group size ", group,
                        " must divide the world size ", size,
                        " (parallel.hybrid_group_size, default: the ranks of one node)");
        shard_color = static_cast<int>(rank / group);
        replicate_color = static_cast<int>(rank % group);
      }
      auto shard = world->split(shard_color, rank);
      auto replicate = world->split(replicate_color, rank);
      logging::info("FSDP hybrid_shard: shard groups of ", shard->size(), " rank(s) (",
                    options.hybrid_group_size() > 0 ? "parallel.hybrid_group_size"
                    : nodes.empty()                 ? "LOCAL_WORLD_SIZE"
                                                    : "one per node, as the rendezvous found them",
                    "), ", replicate->size(), " replica(s)");
      if (shard->size() > 1) g.shard = shard;
      if (replicate->size() > 1) g.replicate = replicate;
      break;
    }
  }
  if (g.shard && options.separate_reduce_group()) g.reduce = g.shard->split(0, g.shard->rank());
  return g;
}

// The identity on a unit's input whose backward tells the unit that its input gradient is
// computed (FSDPState::unit_input).
struct PostBackward : torch::autograd::Function<PostBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            FSDPState* state, int64_t unit) {
    ctx->saved_data["state"] = reinterpret_cast<int64_t>(state);
    ctx->saved_data["unit"] = unit;
    return x;  // autograd makes the output a view of x with this node as its history
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* state = reinterpret_cast<FSDPState*>(ctx->saved_data["state"].toInt());
    state->post_backward(ctx->saved_data["unit"].toInt());
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

FSDPState::FSDPState(std::vector<UnitSpec> units, UnitSpec root,
                     std::vector<std::pair<std::string, at::Tensor>> buffers,
                     std::vector<std::string> param_order,
                     std::shared_ptr<comm::Communicator> world, FSDPOptions options)
    : options_(std::move(options)) {
  DTRAIN_CHECK_AS(UsageError, world != nullptr, "FSDP needs a communicator");
  options_.mixed_precision().validate();
  DTRAIN_CHECK_AS(UsageError, options_.limit_all_gathers() >= 1,
                  "FSDP: limit_all_gathers must be >= 1, got ", options_.limit_all_gathers());
  groups_ = make_groups(world, options_);
  const auto& mp = options_.mixed_precision();
  // Buffers: rank 0's values, in buffer_dtype when set (FSDP's MixedPrecision.buffer_dtype).
  {
    c10::NoGradGuard no_grad;
    for (auto& [name, b] : buffers) {
      DTRAIN_CHECK_AS(UsageError, !is_placeholder(b), "FSDP: buffer '", name,
                      "' is a placeholder; deferred initialization covers parameters only, so "
                      "build buffers with their values");
      if (mp.buffer_dtype && c10::isFloatingType(b.scalar_type())) {
        b.set_data(b.to(*mp.buffer_dtype));
      }
      if (options_.sync_module_states() && world->size() > 1) {
        at::Tensor t = b.contiguous();
        world->broadcast(t, 0).wait();
        if (!t.is_same(b)) b.copy_(t);
      }
    }
  }
  if (!root.params.empty()) {
    root.name = "<root>";
    units.push_back(std::move(root));
    root_ = static_cast<int64_t>(units.size()) - 1;
  }
  // Up to limit_all_gathers units are gathered at once: keep that many buffers of each size
  // for the next step (more raised the peak, 241 -> 260 MB on the 19M model, for no speed).
  pool_ = std::make_unique<BufferPool>(options_.limit_all_gathers());
  // One unit at a time: with param_init, each unit exists whole only while it is built.
  const ParamInit* init = options_.param_init() ? &options_.param_init() : nullptr;
  for (auto& spec : units) {
    units_.push_back(std::make_unique<FlatUnit>(spec.name, std::move(spec.params), groups_, mp,
                                                options_.sync_module_states(), pool_.get(),
                                                options_.shard_layout(), init));
  }
  // Hooks after the units changed the parameters' dtype (which drops their accumulators).
  for (size_t u = 0; u < units_.size(); ++u) {
    const int64_t unit = static_cast<int64_t>(u);
    hooks_.push_back(
        units_[u]->hook_gradients([this, unit](int64_t i) { on_grad_ready(unit, i); }));
  }
  std::map<std::string, std::pair<int64_t, int64_t>> where;
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& ps = units_[u]->params();
    for (size_t i = 0; i < ps.size(); ++i) {
      where[ps[i].name] = {static_cast<int64_t>(u), static_cast<int64_t>(i)};
    }
  }
  for (const auto& name : param_order) {
    auto it = where.find(name);
    if (it != where.end()) order_.push_back(it->second);
  }
  ready_.assign(units_.size(), false);
  in_forward_order_.assign(units_.size(), false);
  ran_since_sync_.assign(units_.size(), false);
  stepped_.assign(units_.size(), 0);
  inputs_marked_.assign(units_.size(), 0);
  inputs_pending_.assign(units_.size(), 0);
  inputs_done_.assign(units_.size(), false);
  trace_forward_start_.assign(units_.size(), -1);
  trace_backward_start_.assign(units_.size(), -1);
  int64_t total = 0, shard = 0;
  for (const auto& u : units_) {
    total += u->numel();
    shard += u->shard_numel();
  }
  logging::debug("FSDP: ", units_.size(), " units (", root_ >= 0 ? "root included" : "no root",
                 "), ", total, " parameters, ", shard, " per rank, strategy ",
                 to_string(options_.sharding_strategy()), ", shard group ",
                 groups_.shard ? groups_.shard->size() : 1, ", replicas ",
                 groups_.replicate ? groups_.replicate->size() : 1, ", policy ", mp.to_string());
}

FSDPState::~FSDPState() {
  abandon_backward();
  hooks_.clear();
}

bool FSDPState::reshards_after_forward(int64_t unit) const {
  if (unit == root_) return false;  // the root stays gathered until its backward (FSDP2)
  auto s = options_.sharding_strategy();
  return s == ShardingStrategy::kFullShard || s == ShardingStrategy::kHybridShard;
}

bool FSDPState::reshards_after_backward(int64_t unit) const {
  // Without frozen parameters, a unit's last gradient is the end of its backward: every
  // node that reads a trainable parameter also produces its gradient.
  return !units_[unit]->has_frozen_params();
}

void FSDPState::maybe_reshard_in_backward(int64_t unit) {
  FlatUnit& u = *units_[unit];
  // Once its inputs' gradients are computed, nothing of its backward is left. Before that,
  // its last gradient ends it unless frozen parameters may still be read (held until the
  // inputs' gradients, or the end of backward when no input carried one).
  if (inputs_done_[unit] || (u.grads_done() && reshards_after_backward(unit))) u.reshard();
}

int64_t FSDPState::gathered_units() const {
  int64_t n = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (static_cast<int64_t>(u) == root_ || units_[u]->shard_group_size() == 1) continue;
    if (units_[u]->state() != FlatUnit::State::kSharded) ++n;
  }
  return n;
}

void FSDPState::prefetch(int64_t unit) {
  if (unit < 0 || units_[unit]->state() != FlatUnit::State::kSharded) return;
  if (gathered_units() >= options_.limit_all_gathers()) return;
  units_[unit]->unshard();
  note_gathered();
}

void FSDPState::gather(int64_t unit) {
  units_[unit]->wait_unsharded(&exposed_s_);
  note_gathered();
}

void FSDPState::note_gathered() { peak_gathered_ = std::max(peak_gathered_, gathered_units()); }

void FSDPState::abandon_backward() {
  // A backward that ended early (an exception) left reductions in flight: finish them so
  // their results never land in buffers the next iteration uses. With the optimizer in
  // backward, what reached the units not stepped (the one whose step threw among them) is
  // dropped too: the masters hold no gradient between steps, and one left here would be added
  // to the next step's.
  for (auto& u : units_) {
    if (u->reduce_launched()) {
      try {
        u->finish_reduce(nullptr);
      } catch (const PeerLostError&) {
        // A peer is gone, or a wait timed out: the error that ends the step says so once.
      } catch (const TimeoutError&) {
      } catch (const std::exception& e) {
        logging::warn("FSDP: a gradient reduction left behind by an aborted backward failed: ",
                      e.what());
      }
    }
    if (step_in_backward_) u->drop_grads();
    u->reset_backward();
  }
  in_backward_ = false;
  pending_backward_ = false;
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(stepped_.begin(), stepped_.end(), 0);
  reset_input_counts();
}

void FSDPState::root_pre_forward() {
  std::lock_guard<std::mutex> lock(mu_);
  if (in_backward_) abandon_backward();
  grad_forward_ = c10::GradMode::is_enabled();
  if (grad_forward_ && !pending_backward_) {
    // A new iteration (a forward without grad never starts one: it must not disturb the
    // state of a training forward whose backward is still to come).
    if (!forward_order_.empty()) previous_order_ = forward_order_;
    forward_order_.clear();
    std::fill(in_forward_order_.begin(), in_forward_order_.end(), false);
    reset_input_counts();
    exposed_s_ = 0;
  }
  if (root_ >= 0) {
    if (trace::enabled()) trace_forward_start_[root_] = trace::now_us();
    gather(root_);
  }
}

void FSDPState::trace_forward_end(int64_t unit) {
  if (unit < 0 || !trace::enabled() || trace_forward_start_[unit] < 0) return;
  trace::complete("forward " + units_[unit]->name(), "unit", trace::kMain,
                  trace_forward_start_[unit], trace::now_us());
  trace_forward_start_[unit] = -1;
}

void FSDPState::root_post_forward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.monitor() != nullptr) {
    for (const auto& t : outputs) options_.monitor()->record("fsdp.<root>.out", t);
  }
  if (grad_forward_) {
    for (const auto& t : outputs) pending_backward_ = pending_backward_ || t.requires_grad();
  } else {
    // The root stays gathered for a training forward's backward still to come.
    for (size_t u = 0; u < units_.size(); ++u) {
      if (!(pending_backward_ && static_cast<int64_t>(u) == root_)) units_[u]->reshard();
    }
  }
  trace_forward_end(root_);
}

void FSDPState::unit_pre_forward(int64_t unit) {
  std::lock_guard<std::mutex> lock(mu_);
  if (grad_forward_) {
    if (!in_forward_order_[unit]) forward_order_.push_back(unit);
    in_forward_order_[unit] = true;
    ran_since_sync_[unit] = true;
  }
  if (trace::enabled()) trace_forward_start_[unit] = trace::now_us();
  gather(unit);
  if (options_.forward_prefetch()) {
    auto it = std::find(previous_order_.begin(), previous_order_.end(), unit);
    if (it != previous_order_.end() && it + 1 != previous_order_.end()) prefetch(*(it + 1));
  }
}

void FSDPState::unit_post_forward(int64_t unit, const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.monitor() != nullptr) {
    for (const auto& t : outputs) {
      options_.monitor()->record("fsdp." + units_[unit]->name() + ".out", t);
    }
  }
  if (!grad_forward_ || reshards_after_forward(unit)) units_[unit]->reshard();
  trace_forward_end(unit);
}

void FSDPState::ensure_backward_started() {
  if (in_backward_) return;
  in_backward_ = true;
  if (trace::enabled()) trace_backward_begin_ = trace_last_backward_end_ = trace::now_us();
  // Reductions run in reverse forward order, then units that ran only in earlier no_sync
  // iterations (their accumulated gradients), the root's last. A unit without trainable
  // parameters has nothing to reduce.
  backward_order_.clear();
  for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it) {
    if (units_[*it]->trainable_count() > 0) backward_order_.push_back(*it);
  }
  if (require_sync_) {
    for (size_t u = 0; u < units_.size(); ++u) {
      const int64_t unit = static_cast<int64_t>(u);
      if (ran_since_sync_[u] && !in_forward_order_[u] && unit != root_ &&
          units_[u]->trainable_count() > 0) {
        backward_order_.push_back(unit);
      }
    }
  }
  if (root_ >= 0 && units_[root_]->trainable_count() > 0) backward_order_.push_back(root_);
  next_launch_ = next_finish_ = next_step_ = 0;
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& u : units_) u->begin_backward();
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
}

void FSDPState::pre_backward(int64_t unit) {
  std::lock_guard<std::mutex> lock(mu_);
  ensure_backward_started();
  if (unit < 0) {
    // A forward without grad since the training forward may have resharded the root.
    if (root_ >= 0) gather(root_);
    return;
  }
  if (trace::enabled()) trace_backward_start_[unit] = trace::now_us();
  gather(unit);
  if (options_.backward_prefetch()) {
    auto it = std::find(backward_order_.begin(), backward_order_.end(), unit);
    if (it != backward_order_.end() && it + 1 != backward_order_.end()) prefetch(*(it + 1));
  }
}

void FSDPState::on_grad_ready(int64_t unit, int64_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  ensure_backward_started();
  FlatUnit& u = *units_[unit];
  DTRAIN_CHECK_AS(UsageError, !inputs_done_[unit], "FSDP: parameter '", u.params()[param].name,
                  "' of unit '", u.name(),
                  "' received its gradient after the gradients of the unit's inputs, so "
                  "through a tensor computed from it outside the unit's forward (an "
                  "auxiliary loss on its parameters, say); the unit was already reduced. "
                  "Compute such terms inside the unit's forward and return them with its "
                  "outputs.");
  const bool all = require_sync_ ? u.grad_ready(param) : u.count_ready(param);
  if (!all) return;
  ready_[unit] = true;
  if (trace::enabled()) {
    // On a track of its own, each unit's backward from its pre-backward hook to its last
    // gradient, starting no earlier than the previous unit's ended (so the track nests).
    const int64_t end = trace::now_us();
    const int64_t began =
        trace_backward_start_[unit] >= 0 ? trace_backward_start_[unit] : trace_backward_begin_;
    const int64_t start = std::max(began, trace_last_backward_end_);
    trace::complete("backward " + u.name(), "unit", trace::track("backward units"), start,
                    std::max(start, end));
    trace_last_backward_end_ = std::max(start, end);
    trace_backward_start_[unit] = -1;
  }
  if (require_sync_) launch_ready();
  maybe_reshard_in_backward(unit);
}

at::Tensor FSDPState::unit_input(int64_t unit, const at::Tensor& t) {
  at::Tensor x = cast_input(t, false);
  if (!grad_forward_ || !x.defined() || !x.requires_grad()) return x;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++inputs_marked_[unit];
    ++inputs_pending_[unit];
  }
  return PostBackward::apply(x, this, unit);
}

void FSDPState::post_backward(int64_t unit) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!in_backward_ || inputs_pending_[unit] == 0) return;
  if (--inputs_pending_[unit] > 0) return;
  inputs_done_[unit] = true;
  if (!ready_[unit]) {
    // Trainable parameters that did not report are unused in this backward: launch_reduce
    // takes what earlier no_sync backwards accumulated on them, or zeros.
    ready_[unit] = true;
    if (require_sync_) launch_ready();
  }
  maybe_reshard_in_backward(unit);
}

void FSDPState::launch_reduce(FlatUnit& u) {
  u.launch_reduce();
  ++reductions_launched_;
}

void FSDPState::reset_input_counts() {
  std::fill(inputs_marked_.begin(), inputs_marked_.end(), 0);
  std::fill(inputs_pending_.begin(), inputs_pending_.end(), 0);
  std::fill(inputs_done_.begin(), inputs_done_.end(), false);
}

void FSDPState::launch_ready() {
  while (next_launch_ < backward_order_.size() && ready_[backward_order_[next_launch_]]) {
    finish_previous_reduce();
    FlatUnit& u = *units_[backward_order_[next_launch_++]];
    if (!u.reduce_launched()) launch_reduce(u);
  }
}

void FSDPState::finish_previous_reduce() {
  // The reduce-scatters are waited for here; HYBRID_SHARD's replica all-reduces stay in
  // flight until finalize_backward. With the optimizer in backward, a unit is stepped once
  // its reduction is final: at once without replicas; under HYBRID_SHARD when the next
  // unit's scatter is done, so one replica all-reduce stays in flight behind the backward.
  for (; next_finish_ < next_launch_; ++next_finish_) {
    const int64_t unit = backward_order_[next_finish_];
    FlatUnit& u = *units_[unit];
    const bool replicas_pending = u.finish_scatter(&exposed_s_);
    if (!replicas_pending) u.finish_reduce(&exposed_s_);
    if (!step_in_backward_) continue;
    // Every unit before this one, and this one too when its reduction is already final.
    const size_t final_until = replicas_pending ? next_finish_ : next_finish_ + 1;
    for (; next_step_ < final_until; ++next_step_) step_unit(backward_order_[next_step_]);
  }
}

void FSDPState::set_step_in_backward(StepInBackward step) {
  std::lock_guard<std::mutex> lock(mu_);
  DTRAIN_CHECK_AS(UsageError, !in_backward_, "FSDP: set_step_in_backward called during a backward");
  step_in_backward_ = std::move(step);
}

void FSDPState::step_unit(int64_t unit) {
  if (stepped_[unit]) return;
  stepped_[unit] = true;
  FlatUnit& u = *units_[unit];
  // A unit prefetched for a backward that never reached it is still being gathered from its
  // shard: let the all-gather finish reading it before the step writes it.
  if (u.state() == FlatUnit::State::kGathering) u.wait_unsharded(&exposed_s_);
  u.finish_reduce(&exposed_s_);
  record_grads(u);
  std::vector<at::Tensor> params;
  for (const auto& p : u.params()) {
    if (p.trainable && p.master.grad().defined()) params.push_back(p.master);
  }
  if (!params.empty()) step_in_backward_(params);
  u.drop_grads();
}

void FSDPState::record_grads(const FlatUnit& u) const {
  if (options_.monitor() == nullptr) return;
  for (const auto& p : u.params()) {
    if (p.trainable && p.master.grad().defined()) {
      options_.monitor()->record("fsdp." + u.name() + ".grad", p.master.grad());
    }
  }
}

void FSDPState::finalize_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!in_backward_) return;
  c10::NoGradGuard no_grad;
  if (require_sync_) {
    // Units whose hooks never all fired (unused parameters) reduce zeros for the rest, in
    // order, so every rank issues the same collectives.
    for (; next_launch_ < backward_order_.size(); ++next_launch_) {
      finish_previous_reduce();
      FlatUnit& u = *units_[backward_order_[next_launch_]];
      if (!u.reduce_launched()) launch_reduce(u);
    }
    for (int64_t unit : backward_order_) {
      if (step_in_backward_) {
        step_unit(unit);
        continue;
      }
      FlatUnit& u = *units_[unit];
      u.finish_reduce(&exposed_s_);
      record_grads(u);
    }
  }
  std::fill(stepped_.begin(), stepped_.end(), 0);
  for (auto& u : units_) {
    u->reshard();
    u->reset_backward();
  }
  if (require_sync_) std::fill(ran_since_sync_.begin(), ran_since_sync_.end(), false);
  pending_backward_ = false;
  reset_input_counts();
  ReducerStats stats;
  stats.exposed_seconds = exposed_s_;
  stats_works_.clear();
  for (auto& u : units_) {
    for (auto& w : u->take_works()) {
      stats_works_.push_back(std::move(w));
      ++stats.buckets;
    }
  }
  stats_ = stats;
  in_backward_ = false;
}

const ReducerStats& FSDPState::last_stats() const {
  for (const auto& w : stats_works_) {
    w.synchronize();
    stats_.comm_seconds += w.busy_seconds();
  }
  stats_works_.clear();
  return stats_;
}

at::Tensor FSDPState::cast_input(const at::Tensor& t, bool root) const {
  const auto& mp = options_.mixed_precision();
  const bool cast = root ? mp.is_low_precision() : mp.cast_forward_inputs;
  if (!cast || !t.defined() || !c10::isFloatingType(t.scalar_type()) ||
      t.scalar_type() == mp.param_dtype) {
    return t;
  }
  return t.to(mp.param_dtype);
}

at::Tensor FSDPState::cast_output(const at::Tensor& t) const {
  const auto& out = options_.mixed_precision().output_dtype;
  if (!out || !t.defined() || !c10::isFloatingType(t.scalar_type()) || t.scalar_type() == *out) {
    return t;
  }
  return t.to(*out);
}

std::vector<at::Tensor> FSDPState::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& [u, i] : order_) {
    const auto& p = units_[u]->params()[i];
    if (p.trainable) out.push_back(p.master);
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPState::full_parameters() const {
  auto masters = all_parameters();
  std::vector<at::Tensor> parts;
  for (const auto& m : masters) parts.push_back(m.second);
  std::vector<at::Tensor> full = gather_full(parts);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t k = 0; k < masters.size(); ++k) out.emplace_back(masters[k].first, full[k]);
  return out;
}

void FSDPState::visit_full_parameters(
    const std::function<void(size_t k, const std::string& name, const at::Tensor& full)>& visit)
    const {
  for (size_t u = 0; u < units_.size(); ++u) {
    const FlatUnit& unit = *units_[u];
    std::vector<at::Tensor> mine;
    for (const auto& p : unit.params()) mine.push_back(p.master);
    const at::Tensor full = unit.gather(unit.flat_of(mine));
    for (size_t k = 0; k < order_.size(); ++k) {
      if (order_[k].first != static_cast<int64_t>(u)) continue;
      const auto& p = unit.params()[order_[k].second];
      visit(k, p.name, full.narrow(0, p.offset, p.numel).view(p.shape));
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> FSDPState::all_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [u, i] : order_) {
    const auto& p = units_[u]->params()[i];
    out.emplace_back(p.name, p.master);
  }
  return out;
}

std::vector<at::Tensor> FSDPState::gather_full(const std::vector<at::Tensor>& parts) const {
  DTRAIN_CHECK_AS(UsageError, parts.size() == order_.size(), "FSDP gather_full: ", parts.size(),
                  " parts for ", order_.size(), " parameters");
  std::vector<at::Tensor> out(order_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    const FlatUnit& unit = *units_[u];
    std::vector<at::Tensor> mine(unit.params().size());
    for (size_t k = 0; k < order_.size(); ++k) {
      if (order_[k].first == static_cast<int64_t>(u)) mine[order_[k].second] = parts[k];
    }
    at::Tensor full = unit.gather(unit.flat_of(mine));
    for (size_t k = 0; k < order_.size(); ++k) {
      if (order_[k].first != static_cast<int64_t>(u)) continue;
      const auto& p = unit.params()[order_[k].second];
      out[k] = full.narrow(0, p.offset, p.numel).view(p.shape);  // keeps the unit's flat alive
    }
  }
  return out;
}

std::vector<at::Tensor> FSDPState::local_parts(const std::vector<at::Tensor>& full) const {
  std::vector<at::Tensor> out;
  for (size_t k = 0; k < order_.size(); ++k) {
    const auto& p = units_[order_[k].first]->params()[order_[k].second];
    out.push_back(full[k].reshape({-1}).narrow(0, p.master_begin, p.master.numel()).clone());
  }
  return out;
}

std::vector<FSDPState::UnitLayout> FSDPState::layouts() const {
  std::vector<UnitLayout> out;
  for (const auto& u : units_) {
    UnitLayout l;
    l.name = u->name();
    l.layout = u->layout();
    l.numel = u->numel();
    l.shard_size = u->shard_numel();
    l.shard_group_size = u->shard_group_size();
    l.shard_rank = u->shard_rank();
    for (const auto& p : u->params()) l.params.push_back({p.name, p.shape, p.place()});
    out.push_back(std::move(l));
  }
  return out;
}

std::vector<at::Tensor> FSDPState::flat_shards(const std::vector<at::Tensor>& parts,
                                               const std::vector<at::Tensor>& into) const {
  std::vector<std::vector<at::Tensor>> by_unit(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) by_unit[u].resize(units_[u]->params().size());
  for (size_t k = 0; k < order_.size(); ++k) by_unit[order_[k].first][order_[k].second] = parts[k];
  std::vector<at::Tensor> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    out.push_back(units_[u]->flat_of(by_unit[u], u < into.size() ? into[u] : at::Tensor()));
  }
  return out;
}

std::vector<at::Tensor> FSDPState::parts_from(const PartReader& read) const {
  std::vector<at::Tensor> out;
  for (const auto& [u, i] : order_) {
    const auto& p = units_[u]->params()[i];
    const int64_t count = p.master.numel();
    out.push_back(count > 0 ? read(u, i, p.master_begin, count).to(p.master.device())
                            : at::empty({0}, p.master.options().requires_grad(false)));
  }
  return out;
}

void FSDPState::set_parameters(const std::vector<at::Tensor>& parts) {
  c10::NoGradGuard no_grad;
  auto masters = all_parameters();
  DTRAIN_CHECK_AS(UsageError, parts.size() == masters.size(), "FSDP set_parameters: ", parts.size(),
                  " parts for ", masters.size(), " parameters");
  for (size_t k = 0; k < parts.size(); ++k) {
    DTRAIN_CHECK_AS(UsageError, parts[k].numel() == masters[k].second.numel(), "FSDP: part of '",
                    masters[k].first, "' has ", parts[k].numel(), " elements, this rank holds ",
                    masters[k].second.numel());
    masters[k].second.copy_(parts[k].reshape({-1}));
  }
  for (auto& u : units_) u->reshard();  // gathered copies (N = 1: refreshed at next forward)
}

std::vector<std::pair<std::string, at::Tensor>> FSDPState::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [u, i] : order_) {
    const auto& p = units_[u]->params()[i];
    if (p.trainable) out.emplace_back(p.name, p.master);
  }
  return out;
}

int64_t FSDPState::pooled_bytes() const { return pool_ ? pool_->pooled_bytes() : 0; }

}  // namespace dtrain::sharding
