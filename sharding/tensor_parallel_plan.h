// A tensor-parallel plan, applied (PyTorch's parallelize_module for LibTorch modules): names of
// submodules mapped to styles (sharding/tensor_parallel.h), each parameter of a matched layer
// replaced, in place, by this rank's slice, and the styles remembered for the model's forward.
//
//   Plan plan = {{"model.layers.*.self_attn.q_proj", Style::kColwise}, ...};
//   auto tp = std::make_shared<TensorParallelism>(tp_group, /*sequence_parallel=*/true);
//   tp->apply(*model, plan);          // parameters sliced; model code then calls tp->linear()
//
// A pattern matches a module's dotted name, '*' standing for one component. A parameter of no
// matched layer (the norms) stays whole on every rank: "replicated". Under sequence
// parallelism the replicated parameters see only this rank's part of the sequence, so their
// gradients are summed over the group after backward (sync_replicated_grads), as Megatron does.
//
// The model's forward asks the TensorParallelism for each layer (by its weight tensor):
//   linear(x, w, b)          the style of w: colwise (input through copy_to_tp, or gathered under
//                            sequence parallelism, keeping only the local part for backward),
//                            rowwise (output through reduce_from_tp or reduce_scatter_seq), or a
//                            plain linear for a weight no style names;
//   embedding(tokens, w)     the residual stream the blocks take: a vocab-parallel lookup and
//                            its reduction (plain when not sliced), its sequence split over the
//                            group under sequence parallelism;
//   loss(logits, targets, w) vocab-parallel cross-entropy for logits of a head w that left them
//                            sharded (colwise or vocab), plain cross-entropy otherwise;
//   gather_vocab(logits, w)  the whole logits of such a head (for sampling).
// Slices: colwise cuts dim 0 (and the bias), rowwise dim 1 (the bias stays whole, added once
// after the reduction), vocab dim 0; each into equal chunks, rank r holding chunk r. A dimension
// the group does not divide is refused, naming the parameter.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "sharding/deferred_init.h"

namespace dtrain::sharding {

enum class Style { kColwise, kRowwise, kVocab };
const char* style_name(Style s);

using Plan = std::vector<std::pair<std::string, Style>>;

// Whether a dotted module name matches a pattern ('*': one component).
bool plan_matches(const std::string& pattern, const std::string& name);

class TensorParallelism {
 public:
  // `regather` (sequence parallelism): column-wise layers keep only this rank's part of the
  // sequence for backward and all-gather it again there (Megatron-LM's way: activations 1/tp,
  // two all-gathers more per layer); false keeps the gathered sequence from forward to
  // backward (PyTorch's SequenceParallel: the traffic of Megatron's formula, the norms'
  // outputs whole).
  TensorParallelism(std::shared_ptr<comm::Communicator> group, bool sequence_parallel,
                    bool regather = true);

  int size() const { return group_ ? group_->size() : 1; }
  int rank() const { return group_ ? group_->rank() : 0; }
  bool sequence_parallel() const { return sequence_parallel_ && size() > 1; }
  const std::shared_ptr<comm::Communicator>& group() const { return group_; }

  // Slices the parameters of every layer the plan names (placeholders of deferred init stay
  // placeholders, of the slice's shape). Returns "name: style, [full] -> [slice]" lines.
  std::vector<std::string> apply(torch::nn::Module& root, const Plan& plan);

  at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                    const at::Tensor& bias = {}) const;
  // For layers written out in a model's forward: the input of the colwise layers that share it
  // (copy_to_tp, or gather_seq under sequence parallelism: once for q, k and v), and the output
  // of a rowwise one (reduce_from_tp, or reduce_scatter_seq). Identity with one rank.
  at::Tensor enter(const at::Tensor& x) const;
  // Column-wise layers (no bias) that share the input x: each weight's output. Under sequence
  // parallelism x is this rank's part of the sequence, gathered once, and backward keeps only
  // that part (tp::gathered_linears); otherwise enter(x) through each. Plain with one rank.
  std::vector<at::Tensor> colwise(const at::Tensor& x,
                                  const std::vector<at::Tensor>& weights) const;
  at::Tensor leave(const at::Tensor& y) const;
  at::Tensor embedding(const at::Tensor& tokens, const at::Tensor& weight) const;
  // Logits [N, V or V/T] and targets [N].
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets,
                  const at::Tensor& head_weight) const;
  at::Tensor gather_vocab(const at::Tensor& logits, const at::Tensor& head_weight) const;

  // Whether `param` is a slice (its gradient norm sums over the group) or whole on every rank.
  bool sliced(const at::Tensor& param) const;
  // Under sequence parallelism: sums the gradients of the replicated parameters over the group
  // (each rank's covers its part of the sequence), in one all-reduce per dtype. `grads` are those
  // gradients (under FSDP, the shards of them, which every rank of the group holds alike).
  // Collective over the group.
  void sync_replicated_grads(const std::vector<at::Tensor>& grads) const;
  // The replicated parameters, by their names in the module apply() saw.
  const std::vector<std::string>& replicated() const { return replicated_; }

  // For a parameter named `name` (apply()'s names): its full value from this rank's slice
  // (collective over the group: all-gather), or `local` when it is not sliced.
  at::Tensor full(const std::string& name, const at::Tensor& local) const;
  // This rank's slice of a full value of `name` (`full` when not sliced).
  at::Tensor slice(const std::string& name, const at::Tensor& full) const;
  // The full shape of `name`; `local` when it is not sliced.
  std::vector<int64_t> full_shape(const std::string& name, const std::vector<int64_t>& local) const;
  bool sliced(const std::string& name) const { return slice_named(name) != nullptr; }
  // The dimension `name` is cut on (-1: whole on every rank).
  int64_t sliced_dim(const std::string& name) const {
    const Slice* s = slice_named(name);
    return s == nullptr ? -1 : s->dim;
  }
  // An initializer of the whole model's parameters, made to fill slices: the full value is made,
  // then this rank's slice taken (deferred init under FSDP).
  ParamInit slice_init(ParamInit full_init) const;

 private:
  struct Slice {
    Style style = Style::kColwise;
    int64_t dim = 0;        // the dimension cut
    int64_t full_size = 0;  // its full length
    bool bias = false;      // a rowwise bias: whole
    std::vector<int64_t> full_shape;
  };
  const Slice* slice_of(const at::Tensor& param) const;
  const Slice* slice_named(const std::string& name) const;

  std::shared_ptr<comm::Communicator> group_;
  bool sequence_parallel_;
  bool regather_;
  // By tensor: each entry holds a weak reference to its tensor, which keeps the address from
  // being reused by another tensor while the entry lives (a model applied and destroyed, and
  // the next one's parameters allocated where its were), and tells whether it still lives.
  struct ParamSlice {
    c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
    Slice slice;
  };
  std::map<const c10::TensorImpl*, ParamSlice> by_param_;
  std::map<std::string, Slice> by_name_;
  std::vector<std::string> replicated_;
};

}  // namespace dtrain::sharding
