#include "framework/strategy.h"

#include "core/error.h"
#include "framework/task.h"
#include "sharding/clip_grad.h"
#include "sharding/tensor_parallel.h"

namespace dtrain::framework {

at::Tensor Strategy::clip_grad_norm(double max_norm) {
  comm::Communicator* shards = fsdp() != nullptr ? fsdp()->shard_group() : nullptr;
  comm::Communicator* tp = tp_ && tp_->size() > 1 ? tp_->group().get() : nullptr;
  if (in_backward_) {
    DTRAIN_CHECK_AS(UsageError, max_norm <= 0,
                    "clip_grad_norm: the optimizer steps in backward, so the gradients are gone "
                    "before they could be clipped");
    std::vector<at::Tensor> norms;
    for (const auto& p : parameters()) {
      auto it = stepped_norms_.find(p.unsafeGetTensorImpl());
      norms.push_back(it == stepped_norms_.end() ? at::Tensor() : it->second);
    }
    stepped_norms_.clear();
    if (tp != nullptr) return sharding::norm_of_grad_norms_tp(norms, 2.0, shards, tp, tp_sliced());
    return sharding::norm_of_grad_norms(norms, 2.0, shards);
  }
  if (tp != nullptr) {
    // Clipping needs the norm over both dimensions; measuring alone clips by nothing.
    return sharding::clip_grad_norm_tp_(parameters(), max_norm > 0 ? max_norm : 0.0, 2.0, shards,
                                        tp, tp_sliced());
  }
  if (max_norm > 0) return sharding::clip_grad_norm_tensor_(parameters(), max_norm, 2.0, shards);
  return sharding::grad_norm(parameters(), 2.0, shards);
}

void Strategy::set_tensor_parallel(std::shared_ptr<sharding::TensorParallelism> tp,
                                   std::function<at::Tensor()> head) {
  tp_ = std::move(tp);
  head_ = std::move(head);
  tp_sliced_.clear();
}

const std::vector<bool>& Strategy::tp_sliced() {
  if (tp_sliced_.empty() && tp_) {
    // One flag per parameters() entry: FSDP's are its trainable masters (a frozen weight has
    // no master in them); the others' are the module's parameters, frozen ones too.
    if (fsdp() != nullptr) {
      for (const auto& [name, master] : fsdp()->named_parameters()) {
        tp_sliced_.push_back(tp_->sliced(name));
      }
    } else {
      for (const auto& p : module().named_parameters()) tp_sliced_.push_back(tp_->sliced(p.key()));
    }
  }
  return tp_sliced_;
}

void Strategy::finish_backward() {
  if (!tp_ || !tp_->sequence_parallel()) return;
  std::vector<at::Tensor> grads;
  if (fsdp() != nullptr) {
    for (const auto& [name, master] : fsdp()->all_parameters()) {
      if (!tp_->sliced(name) && master.grad().defined()) grads.push_back(master.grad());
    }
  } else {
    for (const auto& p : module().named_parameters()) {
      if (!tp_->sliced(p.key()) && p.value().grad().defined()) grads.push_back(p.value().grad());
    }
  }
  tp_->sync_replicated_grads(grads);
}

at::Tensor Strategy::full_output(const at::Tensor& out) {
  return tp_ && head_ ? tp_->gather_vocab(out, head_()) : out;
}

at::Tensor Strategy::cross_entropy_sum(const at::Tensor& out, const at::Tensor& targets) {
  at::Tensor flat = out.reshape({-1, out.size(-1)});
  const at::Tensor t = targets.reshape(-1);
  if (tp_ && head_ && tp_->size() > 1) {
    // The mean over the targets that count (kIgnoreIndex's left out, as cross_entropy's) times
    // their number, on the device; none counted: 0, as cross_entropy's sum (the mean is NaN).
    const at::Tensor counted = t.ne(sharding::tp::kIgnoreIndex).sum().to(at::kFloat);
    const at::Tensor mean = tp_->loss(flat, t, head_());
    return at::where(counted > 0, mean * counted, at::zeros_like(mean));
  }
  return at::cross_entropy_loss(flat.to(at::kFloat), t, {}, at::Reduction::Sum);
}

int64_t Strategy::sequence_multiple() const {
  return tp_ && tp_->sequence_parallel() ? tp_->size() : 1;
}

at::Tensor Strategy::full_parameter(const std::string& name, const at::Tensor& local) {
  return tp_ ? tp_->full(name, local) : local;
}

void Strategy::step_in_backward(StepParams step) {
  DTRAIN_CHECK_AS(UsageError, fsdp() != nullptr,
                  "the optimizer steps in backward under FSDP only (parallel.strategy: fsdp)");
  fsdp()->set_step_in_backward([this, step = std::move(step)](const std::vector<at::Tensor>& ps) {
    for (const auto& p : ps) {
      stepped_norms_[p.unsafeGetTensorImpl()] = sharding::local_grad_norm(p, 2.0);
    }
    step(ps);
  });
  in_backward_ = true;
}

sharding::DDPOptions ddp_options(const RunConfig& c, amp::NumericsMonitor* monitor) {
  const ParallelConfig& p = c.parallel;
  sharding::DDPOptions o;
  if (p.bucket_cap_mb_set) o.bucket_cap_mb(p.bucket_cap_mb);
  o.find_unused_parameters(p.find_unused_parameters)
      .broadcast_buffers(p.broadcast_buffers)
      .reduce_dtype(c.precision.mixed.effective_reduce_dtype())
      .monitor(monitor);
  return o;
}

sharding::FSDPOptions fsdp_options(const RunConfig& c, amp::NumericsMonitor* monitor) {
  const ParallelConfig& p = c.parallel;
  sharding::FSDPOptions o;
  o.sharding_strategy(p.sharding_strategy)
      .mixed_precision(c.precision.mixed)
      .auto_wrap(
          sharding::AutoWrapPolicy().module_types(p.wrap_modules).min_params(p.wrap_min_params))
      .forward_prefetch(p.forward_prefetch)
      .backward_prefetch(p.backward_prefetch)
      .limit_all_gathers(p.limit_all_gathers)
      .shard_layout(p.shard_layout)
      .hybrid_group_size(p.hybrid_group_size)
      .monitor(monitor);
  return o;
}

at::Tensor cross_entropy(const at::Tensor& output, const Batch& batch) {
  at::Tensor logits = output.to(at::kFloat);  // fp32 whatever the output's dtype, as autocast
  if (logits.dim() > 2) logits = logits.reshape({-1, logits.size(-1)});
  return at::cross_entropy_loss(logits, batch.targets.reshape(-1));
}

}  // namespace dtrain::framework
