#include "sharding/tensor_parallel_plan.h"

#include <c10/core/GradMode.h>

#include <sstream>

#include "comm/coalesced.h"
#include "core/error.h"
#include "sharding/tensor_parallel.h"

namespace dtrain::sharding {
namespace {

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, '.')) out.push_back(part);
  return out;
}

std::string shape_text(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

// Dimension `dim` of `t` moved to the front, contiguous.
at::Tensor dim_first(const at::Tensor& t, int64_t dim) {
  return dim == 0 ? t.contiguous() : t.movedim(dim, 0).contiguous();
}

}  // namespace

const char* style_name(Style s) {
  switch (s) {
    case Style::kColwise:
      return "colwise";
    case Style::kRowwise:
      return "rowwise";
    case Style::kVocab:
      return "vocab";
  }
  return "?";
}

bool plan_matches(const std::string& pattern, const std::string& name) {
  const auto p = split_dots(pattern), n = split_dots(name);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] != "*" && p[i] != n[i]) return false;
  }
  return true;
}

TensorParallelism::TensorParallelism(std::shared_ptr<comm::Communicator> group,
                                     bool sequence_parallel, bool regather)
    : group_(std::move(group)), sequence_parallel_(sequence_parallel), regather_(regather) {}

std::vector<std::string> TensorParallelism::apply(torch::nn::Module& root, const Plan& plan) {
  c10::NoGradGuard no_grad;
  std::vector<std::string> done;
  const int64_t t = size(), r = rank();
  std::map<std::string, bool> sliced_names;
  std::map<const c10::TensorImpl*, const Slice*> cut;  // by this call (a tied weight: once)
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    const std::string& module_name = item.key();
    const Style* style = nullptr;
    for (const auto& [pattern, s] : plan) {
      if (plan_matches(pattern, module_name)) {
        style = &s;
        break;
      }
    }
    if (style == nullptr) continue;
    for (auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const std::string name = module_name + "." + p.key();
      at::Tensor& param = p.value();
      Slice s;
      s.style = *style;
      s.full_shape = param.sizes().vec();
      s.bias = p.key() == "bias" && *style == Style::kRowwise;
      s.dim = *style == Style::kRowwise && !s.bias ? 1 : 0;
      // A tensor that two modules register (a tied weight) is cut once, on one dimension.
      if (auto seen = cut.find(param.unsafeGetTensorImpl()); seen != cut.end()) {
        const Slice& first = *seen->second;
        DTRAIN_CHECK_AS(ConfigError, !s.bias && first.dim == s.dim, "tensor parallelism: ", name,
                        " is a tensor the plan already cut on dim ", first.dim, " (",
                        style_name(first.style), "), and ", style_name(*style), " would ",
                        s.bias ? "keep it whole" : "cut it on dim " + std::to_string(s.dim),
                        ": give a shared (tied) weight styles that cut it alike");
        sliced_names[name] = true;
        by_name_[name] = first;
        done.push_back(name + ": " + style_name(*style) + ", the tensor cut above (shared)");
        continue;
      }
      sliced_names[name] = !s.bias;
      if (s.bias) {  // whole on every rank: added once, after the reduction
        continue;
      }
      DTRAIN_CHECK_AS(ConfigError, param.dim() > s.dim, "tensor parallelism: ", name, " of shape ",
                      shape_text(s.full_shape), " has no dimension ", s.dim, " to cut (",
                      style_name(*style), ")");
      s.full_size = param.size(s.dim);
      DTRAIN_CHECK_AS(ConfigError, s.full_size % t == 0, "tensor parallelism: ", name, " of shape ",
                      shape_text(s.full_shape), " is cut ", style_name(*style), " on dim ", s.dim,
                      " into ", t, " equal parts, and ", s.full_size, " does not divide by ", t,
                      ": choose parallel.tp dividing it");
      const int64_t chunk = s.full_size / t;
      std::vector<int64_t> local = s.full_shape;
      local[s.dim] = chunk;
      if (is_placeholder(param)) {
        param.set_data(
            placeholder(at::empty(local, param.options().device(c10::kMeta)), param.device()));
      } else {
        param.set_data(param.detach().narrow(s.dim, r * chunk, chunk).clone());
      }
      by_param_.insert_or_assign(
          param.unsafeGetTensorImpl(),
          ParamSlice{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), s});
      by_name_[name] = s;
      cut[param.unsafeGetTensorImpl()] = &by_param_.at(param.unsafeGetTensorImpl()).slice;
      done.push_back(name + ": " + style_name(*style) + ", " + shape_text(s.full_shape) + " -> " +
                     shape_text(local));
    }
  }
  for (const auto& p : root.named_parameters()) {
    auto it = sliced_names.find(p.key());
    if (it == sliced_names.end() || !it->second) replicated_.push_back(p.key());
  }
  return done;
}

const TensorParallelism::Slice* TensorParallelism::slice_of(const at::Tensor& param) const {
  auto it = by_param_.find(param.unsafeGetTensorImpl());
  return it == by_param_.end() || it->second.tensor.expired() ? nullptr : &it->second.slice;
}

const TensorParallelism::Slice* TensorParallelism::slice_named(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &it->second;
}

bool TensorParallelism::sliced(const at::Tensor& param) const { return slice_of(param) != nullptr; }

at::Tensor TensorParallelism::linear(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias) const {
  const Slice* s = slice_of(weight);
  if (s == nullptr || size() == 1) return at::linear(x, weight, bias);
  if (s->style == Style::kRowwise) {
    at::Tensor y = at::linear(x, weight);
    y = sequence_parallel() ? tp::reduce_scatter_seq(y, group_) : tp::reduce_from_tp(y, group_);
    return bias.defined() ? y + bias : y;
  }
  // colwise, or a vocab-sliced embedding used as the head: output sharded on its last dim.
  if (sequence_parallel() && regather_) {
    return tp::gathered_linears(x, {weight}, {bias}, group_)[0];
  }
  return at::linear(enter(x), weight, bias);
}

std::vector<at::Tensor> TensorParallelism::colwise(const at::Tensor& x,
                                                   const std::vector<at::Tensor>& weights) const {
  if (sequence_parallel() && regather_) return tp::gathered_linears(x, weights, {}, group_);
  const at::Tensor in = enter(x);
  std::vector<at::Tensor> out;
  for (const auto& w : weights) out.push_back(at::linear(in, w));
  return out;
}

at::Tensor TensorParallelism::enter(const at::Tensor& x) const {
  if (size() == 1) return x;
  return sequence_parallel() ? tp::gather_seq(x, group_) : tp::copy_to_tp(x, group_);
}

at::Tensor TensorParallelism::leave(const at::Tensor& y) const {
  if (size() == 1) return y;
  return sequence_parallel() ? tp::reduce_scatter_seq(y, group_) : tp::reduce_from_tp(y, group_);
}

std::vector<int64_t> TensorParallelism::full_shape(const std::string& name,
                                                   const std::vector<int64_t>& local) const {
  const Slice* s = slice_named(name);
  return s == nullptr ? local : s->full_shape;
}

at::Tensor TensorParallelism::embedding(const at::Tensor& tokens, const at::Tensor& weight) const {
  const Slice* s = slice_of(weight);
  if (s == nullptr || size() == 1) {
    // A whole table under sequence parallelism looks up this rank's part of the sequence only:
    // its gradient then covers those tokens, and sync_replicated_grads sums the parts, as for
    // the norms. (Looking up the whole sequence and splitting it would give every rank the whole
    // sequence's gradient in backward, which the sum would count once per rank.)
    return sequence_parallel() ? at::embedding(weight, tp::split_seq(tokens, group_))
                               : at::embedding(weight, tokens);
  }
  at::Tensor local = tp::vocab_slice_embedding(tokens, weight, rank() * (s->full_size / size()));
  return sequence_parallel() ? tp::reduce_scatter_seq(local, group_)
                             : tp::reduce_from_tp(local, group_);
}

at::Tensor TensorParallelism::loss(const at::Tensor& logits, const at::Tensor& targets,
                                   const at::Tensor& head_weight) const {
  const Slice* s = slice_of(head_weight);
  if (s == nullptr || size() == 1) {
    return at::cross_entropy_loss(logits.to(at::kFloat), targets);
  }
  // The vocabulary start from the plan, not from the weight: under FSDP the weight may be
  // resharded (empty) by the time the loss is taken, after a forward without grad.
  return tp::vocab_parallel_cross_entropy(logits, targets, rank() * (s->full_size / size()),
                                          group_);
}

at::Tensor TensorParallelism::gather_vocab(const at::Tensor& logits,
                                           const at::Tensor& head_weight) const {
  if (slice_of(head_weight) == nullptr || size() == 1) return logits;
  const int64_t last = logits.dim() - 1;
  at::Tensor in = dim_first(logits, last);
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] *= size();
  at::Tensor out = at::empty(shape, in.options());
  group_->all_gather(in, out).wait();
  return out.movedim(0, last);
}

void TensorParallelism::sync_replicated_grads(const std::vector<at::Tensor>& grads) const {
  if (!sequence_parallel()) return;
  // Small tensors (the norms' weights): one buffer per dtype, as Megatron-LM all-reduces its
  // layer norms' gradients, rather than one collective each.
  comm::all_reduce_coalesced(*group_, grads);
}

at::Tensor TensorParallelism::full(const std::string& name, const at::Tensor& local) const {
  const Slice* s = slice_named(name);
  if (s == nullptr || size() == 1) return local;
  at::Tensor in = dim_first(local, s->dim);
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] *= size();
  at::Tensor out = at::empty(shape, in.options());
  group_->all_gather(in, out).wait();
  return s->dim == 0 ? out : out.movedim(0, s->dim).contiguous();
}

at::Tensor TensorParallelism::slice(const std::string& name, const at::Tensor& full) const {
  const Slice* s = slice_named(name);
  if (s == nullptr || size() == 1) return full;
  const int64_t chunk = s->full_size / size();
  return full.narrow(s->dim, rank() * chunk, chunk);
}

ParamInit TensorParallelism::slice_init(ParamInit full_init) const {
  if (!full_init || size() == 1) return full_init;
  return [this, full_init](const std::string& name, at::Tensor& t) {
    const Slice* s = slice_named(name);
    if (s == nullptr) {
      full_init(name, t);
      return;
    }
    at::Tensor whole = at::empty(s->full_shape, t.options());
    full_init(name, whole);
    t.copy_(slice(name, whole));
  };
}

}  // namespace dtrain::sharding
