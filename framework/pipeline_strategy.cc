#include "framework/pipeline_strategy.h"

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <array>
#include <map>

#include "comm/types.h"
#include "core/error.h"
#include "framework/checkpoint/optim_state.h"
#include "framework/config.h"
#include "sharding/clip_grad.h"

namespace dtrain::framework {

namespace {

// The gradients averaged over `dp` in one message, as DDP's reducer averages a bucket
// (sharding/reducer.h): divided before the sum (by the world size in fp32; 16-bit reduce dtypes
// split it as FSDP does, or at world sizes that are not powers of two divide after the cast, as
// PyTorch's compress hooks), so the sum does not overflow where DDP's would not. (A sum then a
// division, ReduceOp::kAvg, overflowed an fp16 sum of two gradients of 40000 to inf.) Over 2
// ranks the bits are DDP's; over 3 or more the ring's order of summation follows the message's
// layout (one per stage here, DDP's buckets there), so they agree within rounding.
void average_as_ddp(comm::Communicator& dp, std::vector<at::Tensor>& grads, at::ScalarType reduce) {
  c10::NoGradGuard no_grad;
  const int64_t world = dp.size();
  std::map<at::ScalarType, std::vector<at::Tensor*>> by_dtype;
  for (auto& g : grads) {
    if (g.defined() && g.numel() > 0) by_dtype[g.scalar_type()].push_back(&g);
  }
  const bool low = reduce == at::kHalf || reduce == at::kBFloat16;
  const bool hooks_order = low && (world & (world - 1)) != 0;
  const sharding::DivideFactors f =
      hooks_order ? sharding::DivideFactors{1.0, 1.0} : sharding::divide_factors(world, reduce);
  for (auto& [dtype, list] : by_dtype) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor* g : list) flat.push_back(g->reshape({-1}));
    at::Tensor contents = at::cat(flat);
    if (f.pre != 1) {
      contents.mul_(at::scalar_tensor(1.0 / f.pre, contents.options().device(c10::kCPU)));
    }
    at::Tensor message = contents.to(reduce);
    if (hooks_order) message.div_(static_cast<double>(world));
    dp.all_reduce(message, comm::ReduceOp::kSum).wait();
    if (!message.is_same(contents)) contents.copy_(message);
    if (f.post != 1) contents.div_(f.post);
    int64_t offset = 0;
    for (at::Tensor* g : list) {
      g->copy_(contents.narrow(0, offset, g->numel()).view(g->sizes()));
      offset += g->numel();
    }
  }
}

}  // namespace
namespace {

// The optimizer state keys a parameter may have (framework/checkpoint/optim_state.h): "step"
// is 0-d, the others have the parameter's shape.
constexpr std::array<const char*, 5> kStateKeys{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                "momentum_buffer"};

std::vector<int64_t> state_shape(const char* key, const at::Tensor& param) {
  return std::string(key) == "step" ? std::vector<int64_t>{} : param.sizes().vec();
}

}  // namespace

PipelineStrategy::PipelineStrategy(PipelineModel model, std::shared_ptr<sharding::DeviceMesh> mesh,
                                   const RunConfig& c)
    : model_(std::move(model)),
      mesh_(std::move(mesh)),
      c_(c),
      pipe_(sharding::pp::make_schedule(c.parallel.pp_schedule, static_cast<int>(c.parallel.pp),
                                        static_cast<int>(c.train.micro_batches),
                                        static_cast<int>(c.parallel.pp_stages_per_rank)),
            mesh_->pp()) {
  const int stages = pipe_.schedule().stages;
  ranges_ = sharding::pp::split_layers(model_.layers, stages, c.parallel.pp_split);
  // Under autocast the boundary carries the compute dtype; the residual stream is fp32 again
  // on the other side (run_stage).
  activation_dtype_ =
      c.precision.mixed.is_low_precision() ? c.precision.mixed.param_dtype : at::kFloat;
  // The pipeline rank of the stage that holds a parameter or buffer, by its name.
  auto owner = [&](const std::string& name) {
    const int64_t layer = model_.layer_of(name);
    int stage = 0;
    if (layer >= model_.layers) {
      stage = stages - 1;
    } else if (layer >= 0) {
      while (ranges_[static_cast<size_t>(stage)].second <= layer) ++stage;
    }
    return pipe_.schedule().rank_of(stage);
  };
  for (const auto& kv : model_.module->named_buffers()) buffer_owner_.push_back(owner(kv.key()));
  for (const auto& kv : model_.module->named_parameters()) {
    owner_.push_back(owner(kv.key()));
    shapes_.push_back(kv.value().sizes().vec());
    // Deferred: this rank's parameters made as the eager constructor makes them.
    if (owner_.back() == pp_rank() && sharding::is_placeholder(kv.value())) {
      DTRAIN_CHECK(static_cast<bool>(model_.init), "pipeline: parameter '", kv.key(),
                   "' is a placeholder, and the model gave no initializer");
      c10::NoGradGuard no_grad;
      at::Tensor full = at::empty(shapes_.back(), kv.value().options().dtype(at::kFloat));
      model_.init(kv.key(), full);
      kv.value().set_data(full.to(kv.value().scalar_type()));
    }
  }
  hold_whole(false);
  // parallel.strategy fsdp: the stage's data-parallel ranks shard its parameters.
  const auto& dp = mesh_->dp();
  if (c.parallel.strategy == ParallelStrategy::kFsdp && dp && dp->size() > 1) {
    shards_ = dp.get();
    layout_ = c.parallel.shard_layout;
    std::vector<std::vector<int64_t>> shapes;
    const std::vector<at::Tensor> params = parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (owner_of(i) != pp_rank()) continue;
      DTRAIN_CHECK(params[i].scalar_type() == at::kFloat, "pipeline: parameter ", i, " is ",
                   params[i].scalar_type(), "; sharded stages hold fp32 parameters");
      own_.push_back(i);
      shapes.push_back(shapes_[i]);
    }
    shard_size_ = sharding::place_params(layout_, shapes, shards_->size(), places_);
    // A parameter's norm combines over the pipeline and the shards: the ranks with this rank's
    // tp coordinate (the world without tensor parallelism).
    const int tp = mesh_->shape().tp;
    norm_group_ = tp == 1 ? mesh_->world() : mesh_->world()->split(mesh_->tp_rank(), 0);
    reshard(nullptr);
    state_sharded_ = true;  // the optimizer's state, made by its steps, takes the shards' shapes
  }
}

at::Tensor PipelineStrategy::shard_of(size_t k, const at::Tensor& whole) const {
  const sharding::Held h = sharding::held_by(layout_, places_[k], shard_size_, shards_->rank());
  return whole.detach().reshape(-1).narrow(0, h.begin, h.count).clone();
}

std::vector<at::Tensor> PipelineStrategy::gather_shards(
    const std::vector<at::Tensor>& shards) const {
  const int64_t n = shards_->size(), S = shard_size_;
  const auto options = at::TensorOptions(at::kFloat).device(device());
  at::Tensor mine = at::zeros({S}, options);
  for (size_t k = 0; k < own_.size(); ++k) {
    if (!shards[k].defined()) continue;
    const sharding::Held h = sharding::held_by(layout_, places_[k], S, shards_->rank());
    mine.narrow(0, h.pos, h.count).copy_(shards[k].detach().reshape(-1));
  }
  at::Tensor all = at::empty({n * S}, options);
  shards_->all_gather(mine, all).wait();
  std::vector<at::Tensor> out(own_.size());
  for (size_t k = 0; k < own_.size(); ++k) {
    if (!shards[k].defined()) continue;
    out[k] = at::empty(shapes_[own_[k]], options);
    at::Tensor flat = out[k].view(-1);
    for (int64_t r = 0; r < n; ++r) {
      const sharding::Held h = sharding::held_by(layout_, places_[k], S, r);
      flat.narrow(0, h.begin, h.count).copy_(all.narrow(0, r * S + h.pos, h.count));
    }
  }
  return out;
}

void PipelineStrategy::unshard(torch::optim::Optimizer* optimizer) {
  if (!holds_shards_ && (optimizer == nullptr || !state_sharded_))
    return;  // nothing to move (each step)
  c10::NoGradGuard no_grad;
  const std::vector<at::Tensor> params = parameters();
  if (holds_shards_) {
    std::vector<at::Tensor> shards;
    for (size_t i : own_) shards.push_back(params[i]);
    const std::vector<at::Tensor> whole = gather_shards(shards);
    for (size_t k = 0; k < own_.size(); ++k) params[own_[k]].set_data(whole[k]);
    holds_shards_ = false;
  }
  // The state apart from the parameters: a restore holds them whole (hold_whole) while the
  // state stays sharded.
  if (optimizer == nullptr || !state_sharded_) return;
  state_sharded_ = false;
  // The state a parameter's shape has, key by key (every data-parallel rank has the same keys:
  // its parameters got gradients alike).
  std::vector<ParamState> states = export_optimizer_state(*optimizer);
  for (size_t key = 1; key < kStateKeys.size(); ++key) {
    std::vector<at::Tensor> parts(own_.size());
    bool any = false;
    for (size_t k = 0; k < own_.size(); ++k) {
      auto it = states[own_[k]].find(kStateKeys[key]);
      if (it != states[own_[k]].end()) parts[k] = it->second;
      any = any || parts[k].defined();
    }
    if (!any) continue;
    const std::vector<at::Tensor> full = gather_shards(parts);
    for (size_t k = 0; k < own_.size(); ++k) {
      if (full[k].defined()) states[own_[k]][kStateKeys[key]] = full[k];
    }
  }
  import_optimizer_state(*optimizer, states);
}

void PipelineStrategy::reshard(torch::optim::Optimizer* optimizer) {
  if (shards_ == nullptr || (holds_shards_ && optimizer == nullptr)) return;
  c10::NoGradGuard no_grad;
  const std::vector<at::Tensor> params = parameters();
  if (!holds_shards_) {
    for (size_t k = 0; k < own_.size(); ++k) {
      at::Tensor p = params[own_[k]];
      p.set_data(shard_of(k, p));
    }
    holds_shards_ = true;
  }
  if (optimizer == nullptr) return;
  state_sharded_ = true;
  std::vector<ParamState> states = export_optimizer_state(*optimizer);
  for (size_t k = 0; k < own_.size(); ++k) {
    for (auto& [key, t] : states[own_[k]]) {
      // Whole state (gathered, or restored from a checkpoint) to its shard; a shard stays (a
      // whole one-row parameter is its own shard on the rank that holds it).
      if (key != "step" && t.sizes().vec() == shapes_[own_[k]]) t = shard_of(k, t);
    }
  }
  import_optimizer_state(*optimizer, states);
}

void PipelineStrategy::hold_whole(bool whole) {
  // The own stages' parameters whole with their values (a restore that finds no checkpoint
  // keeps them); their optimizer state stays sharded until a restore replaces it.
  if (whole) unshard(nullptr);
  c10::NoGradGuard no_grad;
  const std::vector<at::Tensor> params = parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    if (owner_of(i) == pp_rank()) continue;
    at::Tensor p = params[i];
    const bool held = p.sizes().vec() == shapes_[i];
    // set_data keeps the tensor (the optimizer's, the module's) and swaps its storage. An
    // empty one keeps its dimensions (its first one 0): a TP gather of it still has a shape.
    if (whole && !held) p.set_data(at::zeros(shapes_[i], p.options()));
    if (!whole && held && p.numel() > 0) {
      std::vector<int64_t> none = shapes_[i];
      if (!none.empty()) none[0] = 0;
      p.set_data(at::empty(none, p.options()));
    }
  }
}

at::Device PipelineStrategy::device() const { return at::Device(torch_device(c_.device)); }

std::vector<int64_t> PipelineStrategy::activation_shape(const at::Tensor& tokens) const {
  // Under sequence parallelism the residual stream between layers holds this rank's part of
  // the sequence.
  return {tokens.size(0), tokens.size(1) / sequence_multiple(), model_.hidden};
}

at::Tensor PipelineStrategy::run_stage(int stage, const at::Tensor& input) const {
  at::Tensor x = input;
  if (stage > 0 && x.scalar_type() != at::kFloat) x = x.to(at::kFloat);
  const auto& [begin, end] = ranges_[static_cast<size_t>(stage)];
  return model_.forward(x, begin, end);
}

at::Tensor PipelineStrategy::train(const std::vector<Batch>& batches, const LossOf& loss,
                                   const std::function<at::Tensor(const at::Tensor&)>& scale) {
  DTRAIN_CHECK(static_cast<int>(batches.size()) == pipe_.schedule().micro_batches,
               "pipeline: ", batches.size(), " micro-batches for a schedule of ",
               pipe_.schedule().micro_batches);
  std::vector<at::Tensor> losses;  // the last stage's, as logged
  sharding::pp::Pipeline::Step step;
  step.forward = [this](int stage, int, const at::Tensor& x) { return run_stage(stage, x); };
  step.loss = [&](int micro, const at::Tensor& output) {
    at::Tensor l = loss(micro, output);
    losses.push_back(l.detach());
    return scale(l);
  };
  for (const auto& b : batches) step.inputs.push_back(b.inputs);
  step.activation_shape = activation_shape(batches.front().inputs);
  step.activation_dtype = activation_dtype_;
  step.device = device();
  // DDP's stages with broadcast_buffers: each step starts from data-parallel rank 0's
  // buffers, as a DDP module accumulating over micro-batches does (it broadcasts before the
  // forward that follows a synchronizing backward: a step's first).
  const auto& replicas = mesh_->dp();
  if (shards_ == nullptr && replicas && replicas->size() > 1 && c_.parallel.broadcast_buffers) {
    c10::NoGradGuard no_grad;
    size_t b = 0;
    for (const auto& kv : model_.module->named_buffers()) {
      if (buffer_owner_[b++] != pp_rank()) continue;
      at::Tensor msg = kv.value().detach().contiguous();
      replicas->broadcast(msg, 0).wait();
      if (msg.data_ptr() != kv.value().data_ptr()) kv.value().detach().copy_(msg);
    }
  }
  // Sharded: the stage's parameters gathered once for all of the step's micro-batches.
  unshard(nullptr);
  pipe_.run(step);
  // Each stage's gradients averaged over its data-parallel ranks, in one message: scattered
  // as shards, or whole (DDP's).
  const auto& dp = mesh_->dp();
  if (shards_ != nullptr) {
    reduce_scatter_grads();
  } else if (dp && dp->size() > 1) {
    std::vector<at::Tensor> grads;
    const auto params = parameters();
    std::vector<size_t> own;
    for (size_t i = 0; i < params.size(); ++i) {
      if (owner_of(i) == pp_rank()) own.push_back(i);
    }
    // A parameter only some data-parallel ranks' micro-batches used: the others add zeros,
    // as DDP's find_unused_parameters does (one that no rank used keeps no gradient).
    const std::vector<bool> any = any_rank_has_grad(*dp, params, own);
    for (size_t k = 0; k < own.size(); ++k) {
      at::Tensor& p = params[own[k]].mutable_grad();
      if (any[k] && !p.defined()) p = at::zeros_like(params[own[k]]);
      grads.push_back(p);
    }
    average_as_ddp(*dp, grads, c_.precision.mixed.effective_reduce_dtype());
  }
  return pipe_.loss_sum(losses);
}

std::vector<bool> PipelineStrategy::any_rank_has_grad(comm::Communicator& group,
                                                      const std::vector<at::Tensor>& params,
                                                      const std::vector<size_t>& which) {
  at::Tensor has = at::zeros({static_cast<int64_t>(which.size())}, at::kInt);
  for (size_t k = 0; k < which.size(); ++k) {
    if (params[which[k]].grad().defined()) has[static_cast<int64_t>(k)] = 1;
  }
  has = has.to(group.device());
  group.all_reduce(has, comm::ReduceOp::kMax).wait();
  has = has.cpu();
  std::vector<bool> any(which.size());
  const auto a = has.accessor<int32_t, 1>();
  for (size_t k = 0; k < which.size(); ++k) any[k] = a[static_cast<int64_t>(k)] != 0;
  return any;
}

void PipelineStrategy::reduce_scatter_grads() {
  c10::NoGradGuard no_grad;
  const int64_t n = shards_->size(), S = shard_size_;
  const at::ScalarType reduce = c_.precision.mixed.effective_reduce_dtype();
  // FSDP2's averaging, as sharding/fsdp_unit.cc does it.
  const sharding::DivideFactors f = sharding::fsdp_averages_after(reduce)
                                        ? sharding::DivideFactors{1.0, static_cast<double>(n)}
                                        : sharding::divide_factors(n, reduce);
  const std::vector<at::Tensor> params = parameters();
  at::Tensor input = at::zeros({n * S}, at::TensorOptions(reduce).device(device()));
  // Every rank takes its shard of a gradient that any rank had (the others added zeros): a
  // parameter only some ranks' micro-batches used is stepped on every shard.
  const std::vector<bool> has = any_rank_has_grad(*shards_, params, own_);
  for (size_t k = 0; k < own_.size(); ++k) {
    const at::Tensor& g = params[own_[k]].grad();
    if (!g.defined()) continue;
    const at::Tensor flat = g.reshape(-1);
    for (int64_t r = 0; r < n; ++r) {
      const sharding::Held h = sharding::held_by(layout_, places_[k], S, r);
      input.narrow(0, r * S + h.pos, h.count).copy_(flat.narrow(0, h.begin, h.count));
    }
  }
  // The whole gradients and parameters go before the collective: the step's peak holds
  // the stage's gradients once (in the message), not twice.
  for (size_t i : own_) params[i].mutable_grad() = at::Tensor();
  reshard(nullptr);
  if (f.pre != 1) input.div_(f.pre);
  at::Tensor output = at::empty({S}, input.options());
  shards_->reduce_scatter(input, output, comm::ReduceOp::kSum).wait();
  if (f.post != 1) output.div_(f.post);
  for (size_t k = 0; k < own_.size(); ++k) {
    if (!has[k]) continue;
    const sharding::Held h = sharding::held_by(layout_, places_[k], S, shards_->rank());
    params[own_[k]].mutable_grad() = output.narrow(0, h.pos, h.count).to(at::kFloat).clone();
  }
}

void PipelineStrategy::forward_only(const at::Tensor& inputs,
                                    const std::function<void(const at::Tensor&)>& at_last) {
  const auto& s = pipe_.schedule();
  sharding::pp::Pipeline once(sharding::pp::make_schedule(sharding::pp::ScheduleKind::kForwardOnly,
                                                          s.ranks, 1, s.stages_per_rank()),
                              mesh_->pp());
  sharding::pp::Pipeline::Step step;
  step.forward = [this](int stage, int, const at::Tensor& x) { return run_stage(stage, x); };
  step.loss = [&](int, const at::Tensor& output) {
    at_last(output);
    return at::zeros({}, output.options());
  };
  step.inputs = {inputs};
  step.activation_shape = activation_shape(inputs);
  step.activation_dtype = activation_dtype_;
  step.device = device();
  const bool held = holds_shards_;
  unshard(nullptr);
  once.run(step);
  if (held) reshard(nullptr);
}

at::Tensor PipelineStrategy::evaluate(
    const at::Tensor& inputs, const std::function<at::Tensor(const at::Tensor& output)>& reduce) {
  std::vector<at::Tensor> sums;
  forward_only(inputs, [&](const at::Tensor& output) { sums.push_back(reduce(output).detach()); });
  return pipe_.loss_sum(sums);
}

at::Tensor PipelineStrategy::forward(const at::Tensor& inputs) {
  const auto& s = pipe_.schedule();
  at::Tensor out;
  forward_only(inputs, [&](const at::Tensor& output) { out = output; });
  // The last stage's output to every rank of the pipeline: its shape and dtype first.
  const int last = s.rank_of(s.stages - 1);
  const auto& group = mesh_->pp();
  at::Tensor header = at::zeros({4}, at::kLong);
  if (pp_rank() == last) {
    DTRAIN_CHECK(out.dim() == 3, "pipeline: the last stage's output is ", out.sizes(),
                 ", not [batch, seq, vocab]");
    header =
        at::tensor({out.size(0), out.size(1), out.size(2), static_cast<int64_t>(out.scalar_type())},
                   at::kLong);
  }
  header = header.to(group->device());
  group->broadcast(header, last).wait();
  header = header.cpu();
  const int64_t* h = header.data_ptr<int64_t>();
  at::Tensor whole =
      pp_rank() == last
          ? out.contiguous()
          : at::empty(
                {h[0], h[1], h[2]},
                at::TensorOptions().dtype(static_cast<at::ScalarType>(h[3])).device(device()));
  group->broadcast(whole, last).wait();
  return whole;
}

at::Tensor PipelineStrategy::clip_grad_norm(double max_norm) {
  // Each parameter's gradient is on its stage's rank alone (its data-parallel peers hold the
  // same): per parameter its norm, summed over the pipeline (the owner's, exactly), then the
  // norm of them all in the model's order, as one process takes it: the same bits where one
  // process's parameters all have gradients. (TorchTitan sums each rank's total instead,
  // ShardNorm::kPerRank, which rounds differently.)
  // Sharded, a parameter's norm combines over its shards too: over the pipeline x shards.
  comm::Communicator* group = shards_ != nullptr ? norm_group_.get() : mesh_->pp().get();
  if (tensor_parallel() != nullptr && tensor_parallel()->size() > 1) {
    // The TP slices' norms combine over the tp group too (as without a pipeline).
    return sharding::clip_grad_norm_tp_(parameters(), max_norm > 0 ? max_norm : 0.0, 2.0, group,
                                        tensor_parallel()->group().get(), tp_sliced());
  }
  constexpr auto kRule = sharding::ShardNorm::kPerParameter;
  if (max_norm > 0) {
    return sharding::clip_grad_norm_tensor_(parameters(), max_norm, 2.0, group,
                                            /*error_if_nonfinite=*/false, kRule);
  }
  return sharding::grad_norm(parameters(), 2.0, group, kRule);
}

void PipelineStrategy::share(torch::optim::Optimizer* optimizer, bool to_first) {
  // Sharded: the own stages and their optimizer state whole on every data-parallel rank first.
  unshard(optimizer);
  // To the first stage's rank of the first pipeline alone: the rank that writes.
  if (to_first && mesh_->dp_rank() != 0) return;
  const bool receives = !to_first || pp_rank() == 0;
  if (receives) hold_whole(true);
  const std::vector<at::Tensor> params = parameters();
  std::vector<ParamState> states;
  if (optimizer != nullptr) {
    const std::vector<at::Tensor> held = optimizer_parameters(*optimizer);
    DTRAIN_CHECK(held.size() == params.size(),
                 "pipeline: the optimizer must hold the model's parameters in order");
    for (size_t i = 0; i < held.size(); ++i) {
      DTRAIN_CHECK(held[i].unsafeGetTensorImpl() == params[i].unsafeGetTensorImpl(),
                   "pipeline: the optimizer must hold the model's parameters in order");
    }
    states = export_optimizer_state(*optimizer);
  }
  const auto& group = mesh_->pp();
  const int me = pp_rank();
  // Which state each parameter has, from its owner.
  const size_t K = kStateKeys.size();
  at::Tensor has = at::zeros({static_cast<int64_t>(params.size() * K)}, at::kLong);
  for (size_t i = 0; i < states.size(); ++i) {
    if (owner_of(i) != me) continue;
    for (const auto& [key, t] : states[i]) {
      auto it = std::find_if(kStateKeys.begin(), kStateKeys.end(),
                             [&](const char* k) { return key == k; });
      DTRAIN_CHECK(it != kStateKeys.end(), "pipeline: optimizer state '", key, "' is unknown");
      has[static_cast<int64_t>(i * K + static_cast<size_t>(it - kStateKeys.begin()))] = 1;
    }
  }
  has = has.to(group->device());
  group->all_reduce(has, comm::ReduceOp::kSum).wait();
  has = has.cpu();
  const int64_t* present = has.data_ptr<int64_t>();
  // Each owner's parameters and their state in one message, in parameter order.
  c10::NoGradGuard no_grad;
  for (int owner = 0; owner < pipe_.schedule().ranks; ++owner) {
    std::vector<at::Tensor> mine;  // what the owner sends, in order
    int64_t numel = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      if (owner_of(i) != owner) continue;
      numel += params[i].numel();
      for (size_t k = 0; k < K; ++k) {
        if (!present[i * K + k]) continue;
        numel += k == 0 ? 1 : params[i].numel();
      }
    }
    if (numel == 0) continue;
    const bool sends = owner == me, lands = receives && owner != me;
    if (to_first && (owner == 0 || (!sends && !lands))) continue;  // rank 0 has its own
    at::Tensor flat;
    if (owner == me) {
      std::vector<at::Tensor> parts;
      for (size_t i = 0; i < params.size(); ++i) {
        if (owner_of(i) != owner) continue;
        parts.push_back(params[i].detach().reshape(-1).to(device(), at::kFloat));
        for (size_t k = 0; k < K; ++k) {
          if (!present[i * K + k]) continue;
          parts.push_back(states[i].at(kStateKeys[k]).reshape(-1).to(device(), at::kFloat));
        }
      }
      flat = at::cat(parts);
    } else {
      flat = at::empty({numel}, at::TensorOptions(at::kFloat).device(device()));
    }
    if (!to_first) {
      group->broadcast(flat, owner).wait();
    } else if (sends) {
      group->send(flat, 0).wait();
    } else {
      group->recv(flat, owner).wait();
    }
    if (!lands) continue;
    int64_t at = 0;
    auto next = [&](const std::vector<int64_t>& shape) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      at::Tensor t = flat.narrow(0, at, n).view(shape);
      at += n;
      return t;
    };
    for (size_t i = 0; i < params.size(); ++i) {
      if (owner_of(i) != owner) continue;
      params[i].detach().copy_(next(params[i].sizes().vec()));
      if (optimizer == nullptr) {
        for (size_t k = 0; k < K; ++k) {
          if (present[i * K + k]) next(state_shape(kStateKeys[k], params[i]));
        }
        continue;
      }
      states[i].clear();
      for (size_t k = 0; k < K; ++k) {
        if (!present[i * K + k]) continue;
        at::Tensor t = next(state_shape(kStateKeys[k], params[i]));
        states[i][kStateKeys[k]] = k == 0 ? t.cpu().clone() : t.clone();
      }
    }
  }
  if (optimizer != nullptr && receives) import_optimizer_state(*optimizer, states);
  // Buffers (a norm's running statistics): only their stage's forwards update them, so each
  // comes from its owner, in its own dtype.
  size_t b = 0;
  for (const auto& kv : model_.module->named_buffers()) {
    const int owner = buffer_owner_[b++];
    if (to_first && (owner == 0 || (owner != me && !receives))) continue;
    at::Tensor buffer = kv.value();
    at::Tensor msg = buffer.detach().contiguous();
    if (!to_first) {
      group->broadcast(msg, owner).wait();
    } else if (owner == me) {
      group->send(msg, 0).wait();
    } else {
      group->recv(msg, owner).wait();
    }
    if (owner != me && msg.data_ptr() != buffer.data_ptr()) buffer.detach().copy_(msg);
  }
}

void PipelineStrategy::drop_foreign_state(torch::optim::Optimizer& optimizer) {
  const std::vector<at::Tensor> params = parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    if (owner_of(i) != pp_rank()) optimizer.state().erase(params[i].unsafeGetTensorImpl());
  }
  hold_whole(false);
  reshard(&optimizer);
}

std::vector<std::string> PipelineStrategy::describe() const {
  const auto& s = pipe_.schedule();
  std::vector<std::string> out;
  out.push_back("pipeline: " + std::to_string(s.stages) + " stages over " +
                std::to_string(s.ranks) + " ranks, schedule " +
                sharding::pp::schedule_name(s.kind) + ", " + std::to_string(s.micro_batches) +
                " micro-batches (train.micro_batches), activations in " +
                comm::dtype_name(activation_dtype_) + "; bubble " +
                std::to_string(static_cast<int>(sharding::pp::theoretical_bubble(s) * 100 + 0.5)) +
                "% in theory");
  if (shards_ != nullptr) {
    out.push_back("pipeline: each stage sharded over its " + std::to_string(shards_->size()) +
                  " data-parallel ranks (parallel.strategy fsdp, " +
                  name_of(c_.parallel.shard_layout) +
                  "): gathered once per step, its gradients reduce-scattered once");
  }
  const int per_stage = mesh_->shape().size() / s.ranks;
  for (int stage = 0; stage < s.stages; ++stage) {
    const auto& [begin, end] = ranges_[static_cast<size_t>(stage)];
    std::string what = "layers " + std::to_string(begin) + "-" + std::to_string(end - 1);
    if (stage == 0) what = "the embedding, " + what;
    if (stage == s.stages - 1) what += ", the norm and the head";
    std::string ranks;
    const int r = s.rank_of(stage);
    for (int k = 0; k < per_stage; ++k) {
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r * per_stage + k);
    }
    out.push_back("pipeline: stage " + std::to_string(stage) + ": " + what + " on rank" +
                  (per_stage > 1 ? "s " : " ") + ranks);
  }
  return out;
}

}  // namespace dtrain::framework
