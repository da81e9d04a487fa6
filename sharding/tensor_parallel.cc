#include "sharding/tensor_parallel.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/error.h"

namespace dtrain::sharding::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool trivial(const CommPtr& g) { return g == nullptr || g->size() == 1; }

// The group travels through autograd's saved data as a raw pointer: the caller keeps the
// communicator alive for the backward (the mesh owns it for the whole run).
comm::Communicator* group_of(AutogradContext* ctx) {
  return reinterpret_cast<comm::Communicator*>(ctx->saved_data["group"].toInt());
}
void keep_group(AutogradContext* ctx, const CommPtr& g) {
  ctx->saved_data["group"] = reinterpret_cast<int64_t>(g.get());
}

at::Tensor all_reduced(const at::Tensor& x, comm::Communicator* g,
                       comm::ReduceOp op = comm::ReduceOp::kSum) {
  at::Tensor y = x.contiguous().clone();
  g->all_reduce(y, op).wait();
  return y;
}

// Along dim 1 (the sequence): moved to dim 0, where the flat collectives cut.
// Contiguous: the Linears that take it save it once (a strided view would be copied by each).
at::Tensor gathered_seq(const at::Tensor& x, comm::Communicator* g) {
  at::Tensor in = x.transpose(0, 1).contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] *= g->size();
  at::Tensor out = at::empty(shape, in.options());
  g->all_gather(in, out).wait();
  return out.transpose(0, 1).contiguous();
}

at::Tensor reduce_scattered_seq(const at::Tensor& x, comm::Communicator* g) {
  DTRAIN_CHECK_AS(UsageError, x.size(1) % g->size() == 0, "sequence parallelism: a sequence of ",
                  x.size(1), " tokens does not split over ", g->size(), " tensor-parallel ranks");
  at::Tensor in = x.transpose(0, 1).contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] /= g->size();
  at::Tensor out = at::empty(shape, in.options());
  g->reduce_scatter(in, out).wait();
  return out.transpose(0, 1);
}

at::Tensor chunk_seq(const at::Tensor& x, comm::Communicator* g) {
  DTRAIN_CHECK_AS(UsageError, x.size(1) % g->size() == 0, "sequence parallelism: a sequence of ",
                  x.size(1), " tokens does not split over ", g->size(), " tensor-parallel ranks");
  const int64_t n = x.size(1) / g->size();
  return x.narrow(1, g->rank() * n, n).contiguous();
}

struct CopyToTP : torch::autograd::Function<CopyToTP> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommPtr& g) {
    keep_group(ctx, g);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduced(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromTP : torch::autograd::Function<ReduceFromTP> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x, const CommPtr& g) {
    return all_reduced(x, g.get());
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

struct GatherSeq : torch::autograd::Function<GatherSeq> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommPtr& g) {
    keep_group(ctx, g);
    return gathered_seq(x, g.get());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scattered_seq(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceScatterSeq : torch::autograd::Function<ReduceScatterSeq> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommPtr& g) {
    keep_group(ctx, g);
    return reduce_scattered_seq(x, g.get());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gathered_seq(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct SplitSeq : torch::autograd::Function<SplitSeq> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommPtr& g) {
    keep_group(ctx, g);
    return chunk_seq(x, g.get());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gathered_seq(grads[0], group_of(ctx)), at::Tensor()};
  }
};

// Column-wise Linears that share a sequence-parallel input (q, k and v; gate and up): the input
// gathered over the group, each weight applied. Only this rank's part of the sequence is kept
// for backward, which gathers it again for the weights' gradients, as Megatron-LM's sequence
// parallelism does: an all-gather more per backward instead of the whole sequence held from
// forward to backward. Inputs: x, then the weights, then the biases of the weights
// `has_bias` marks (autograd takes no undefined tensor in a list).
struct GatheredLinears : torch::autograd::Function<GatheredLinears> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList params,
                               c10::List<bool> has_bias, const CommPtr& g) {
    keep_group(ctx, g);
    const size_t n = has_bias.size();
    const at::Tensor full = gathered_seq(x, g.get());
    variable_list out;
    size_t b = n;
    for (size_t i = 0; i < n; ++i) {
      out.push_back(at::linear(full, params[i], has_bias.get(i) ? params[b++] : at::Tensor()));
    }
    variable_list saved = {x};
    for (size_t i = 0; i < n; ++i) saved.push_back(params[i]);
    ctx->save_for_backward(saved);
    ctx->saved_data["bias"] = has_bias;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t n = saved.size() - 1;
    const auto has_bias = ctx->saved_data["bias"].toBoolList();
    comm::Communicator* g = group_of(ctx);
    const at::Tensor full = gathered_seq(saved[0], g);
    const at::Tensor rows = full.reshape({-1, full.size(-1)});
    at::Tensor grad_full;
    variable_list grad_w(n), grad_b;
    for (size_t i = 0; i < n; ++i) {
      at::Tensor gy;
      if (grads[i].defined()) {
        gy = grads[i].reshape({-1, grads[i].size(-1)});
        const at::Tensor gx = at::matmul(grads[i], saved[1 + i]);
        grad_full = grad_full.defined() ? grad_full + gx : gx;
        grad_w[i] = gy.t().mm(rows);
      }
      if (has_bias.get(i)) grad_b.push_back(gy.defined() ? gy.sum(0) : at::Tensor());
    }
    variable_list out = {grad_full.defined() ? reduce_scattered_seq(grad_full, g) : at::Tensor()};
    out.insert(out.end(), grad_w.begin(), grad_w.end());
    out.insert(out.end(), grad_b.begin(), grad_b.end());
    out.push_back(at::Tensor());  // has_bias
    out.push_back(at::Tensor());  // the group
    return out;
  }
};

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, int64_t vocab_start, const CommPtr& g) {
    keep_group(ctx, g);
    const int64_t local = logits.size(-1);
    at::Tensor x = logits.to(at::kFloat);
    at::Tensor max = all_reduced(std::get<0>(x.max(-1)), g.get(), comm::ReduceOp::kMax);
    at::Tensor shifted = x - max.unsqueeze(-1);
    at::Tensor exp = shifted.exp();
    at::Tensor sum_exp = all_reduced(exp.sum(-1), g.get());
    at::Tensor valid = (targets != kIgnoreIndex).to(at::kFloat);
    at::Tensor in_range = (targets >= vocab_start) & (targets < vocab_start + local);
    at::Tensor index = (targets - vocab_start).clamp(0, local - 1);
    at::Tensor target_logit =
        shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * in_range.to(at::kFloat);
    // The target's logit (one rank holds it, the others add zeros) and how many ranks hold each
    // target, in one all-reduce: a target no rank holds is outside the vocabulary.
    at::Tensor both = all_reduced(at::stack({target_logit, in_range.to(at::kFloat)}), g.get());
    DTRAIN_CHECK_AS(UsageError, both[1].equal(valid),
                    "vocab_parallel_cross_entropy: a target is outside [0, the vocabulary size) "
                    "and is not -100 (the ignored index): ",
                    targets.masked_select(both[1] != valid).slice(0, 0, 4));
    at::Tensor count = valid.sum();
    at::Tensor loss = ((sum_exp.log() - both[0]) * valid).sum() / count;  // 0 / 0: NaN, as torch
    ctx->save_for_backward({exp.div_(sum_exp.unsqueeze(-1)), in_range, index, valid, count});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor softmax = saved[0], in_range = saved[1], index = saved[2], valid = saved[3],
               count = saved[4];
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(-1, index.unsqueeze(-1), -in_range.to(at::kFloat).unsqueeze(-1));
    grad.mul_(valid.unsqueeze(-1));
    // No row counted: no gradient (torch's too), rather than 0 x (1 / 0).
    grad.mul_(at::where(count > 0, grads[0] / count, at::zeros_like(count)));
    return {grad.to(static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt())), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_tp(const at::Tensor& x, const CommPtr& group) {
  return trivial(group) ? x : CopyToTP::apply(x, group);
}

at::Tensor reduce_from_tp(const at::Tensor& x, const CommPtr& group) {
  return trivial(group) ? x : ReduceFromTP::apply(x, group);
}

at::Tensor gather_seq(const at::Tensor& x, const CommPtr& group) {
  return trivial(group) ? x : GatherSeq::apply(x, group);
}

at::Tensor reduce_scatter_seq(const at::Tensor& x, const CommPtr& group) {
  return trivial(group) ? x : ReduceScatterSeq::apply(x, group);
}

at::Tensor split_seq(const at::Tensor& x, const CommPtr& group) {
  return trivial(group) ? x : SplitSeq::apply(x, group);
}

std::vector<at::Tensor> gathered_linears(const at::Tensor& x,
                                         const std::vector<at::Tensor>& weights,
                                         const std::vector<at::Tensor>& biases,
                                         const CommPtr& group) {
  DTRAIN_CHECK(biases.empty() || biases.size() == weights.size(),
               "gathered_linears: one bias (or an undefined one) per weight");
  if (trivial(group)) {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < weights.size(); ++i) {
      out.push_back(at::linear(x, weights[i], biases.empty() ? at::Tensor() : biases[i]));
    }
    return out;
  }
  // Under autocast, the cast at::linear would make, made here: autograd takes the gradients
  // back to the parameters' dtype through it, and the function computes in one dtype.
  const auto device = x.device().type();
  const bool cast =
      at::autocast::is_autocast_enabled(device) && at::isFloatingType(x.scalar_type());
  const auto dtype = cast ? at::autocast::get_autocast_dtype(device) : x.scalar_type();
  auto in_dtype = [&](const at::Tensor& t) { return cast ? t.to(dtype) : t; };
  variable_list params;
  for (const auto& w : weights) params.push_back(in_dtype(w));
  c10::List<bool> has_bias;
  for (size_t i = 0; i < weights.size(); ++i) {
    const bool defined = i < biases.size() && biases[i].defined();
    has_bias.push_back(defined);
    if (defined) params.push_back(in_dtype(biases[i]));
  }
  return GatheredLinears::apply(in_dtype(x), at::TensorList(params), has_bias, group);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab_start, const CommPtr& group) {
  if (trivial(group)) {
    return at::cross_entropy_loss(logits.to(at::kFloat), targets);
  }
  DTRAIN_CHECK_AS(UsageError,
                  logits.dim() == 2 && targets.dim() == 1 && logits.size(0) == targets.size(0),
                  "vocab_parallel_cross_entropy: logits [N, V/T] and targets [N], got ",
                  logits.sizes(), " and ", targets.sizes());
  return VocabParallelCrossEntropy::apply(logits, targets, vocab_start, group);
}

at::Tensor vocab_slice_embedding(const at::Tensor& tokens, const at::Tensor& weight,
                                 int64_t vocab_start) {
  const int64_t local = weight.size(0);
  at::Tensor in_range = (tokens >= vocab_start) & (tokens < vocab_start + local);
  at::Tensor index = (tokens - vocab_start).clamp(0, local - 1);
  at::Tensor rows = at::embedding(weight, index);
  return rows * in_range.unsqueeze(-1).to(rows.scalar_type());
}

}  // namespace dtrain::sharding::tp
