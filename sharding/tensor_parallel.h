// Tensor parallelism (Megatron-LM's, as PyTorch's parallelize_module applies it): each rank of a
// TP group holds a slice of a layer's weights and computes a slice of its output; conjugate
// collectives join the slices, in forward and (transposed) in backward.
//
//   copy_to_tp         forward: identity;            backward: all-reduce over the group (f)
//   reduce_from_tp     forward: all-reduce;          backward: identity                   (g)
//   gather_seq         forward: all-gather along dim 1 (the sequence); backward: reduce-scatter
//   reduce_scatter_seq forward: reduce-scatter along dim 1;            backward: all-gather
//   split_seq          forward: this rank's chunk of dim 1;             backward: all-gather
//   gathered_linears   gather_seq then colwise Linears, keeping only the local chunk for
//                      backward (which all-gathers it again)
//
// Styles (sharding/tensor_parallel_plan.h applies them by submodule name):
//   colwise  Linear W [out, in] -> rows [out/T] here: y_local = x W_local^T (+ b_local); the
//            input enters through copy_to_tp (or gather_seq under sequence parallelism), the
//            output stays sharded on its last dimension.
//   rowwise  Linear W [out, in] -> columns [in/T] here: y = reduce(x_local W_local^T) + b; the
//            reduction is reduce_from_tp (or reduce_scatter_seq under sequence parallelism).
//   vocab    Embedding W [V, D] -> rows [V/T] here: each rank looks up the tokens in its range
//            (zeros elsewhere) and the ranks' lookups are summed (reduce_from_tp, or
//            reduce_scatter_seq).
// And vocab_parallel_cross_entropy: the loss of logits sharded on the vocabulary, computed
// without gathering them (Megatron's _VocabParallelCrossEntropy; PyTorch's loss_parallel).
//
// The collectives run on the TP communicator in the tensors' dtype (param_dtype under a
// mixed-precision policy), and every rank of the group must call the same ops in the same
// order, as for every collective. With a null communicator (or one rank) each op is the
// identity, and the styles are the plain layers.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace dtrain::sharding::tp {

using CommPtr = std::shared_ptr<comm::Communicator>;

at::Tensor copy_to_tp(const at::Tensor& x, const CommPtr& group);
at::Tensor reduce_from_tp(const at::Tensor& x, const CommPtr& group);
at::Tensor gather_seq(const at::Tensor& x, const CommPtr& group);
at::Tensor reduce_scatter_seq(const at::Tensor& x, const CommPtr& group);
at::Tensor split_seq(const at::Tensor& x, const CommPtr& group);

// Column-wise Linears sharing a sequence-parallel input x [B, T/G, in] (q, k, v; gate, up):
// the outputs of gather_seq(x) through each weight (and bias; `biases` empty or one per
// weight, undefined for none), [B, T, out/G] each. Backward keeps only x and gathers it again
// (Megatron-LM's sequence parallelism), instead of holding the gathered [B, T, in] from forward
// to backward. With one rank, plain Linears.
std::vector<at::Tensor> gathered_linears(const at::Tensor& x,
                                         const std::vector<at::Tensor>& weights,
                                         const std::vector<at::Tensor>& biases,
                                         const CommPtr& group);

// As at::cross_entropy_loss's default: a row whose target is -100 adds nothing to the loss or
// to the gradient, and the mean is over the other rows.
constexpr int64_t kIgnoreIndex = -100;

// Loss of `logits` [N, V/T] (this rank's vocabulary slice, which starts at vocab_start) against
// `targets` [N] (global ids), averaged over the rows: equal to cross_entropy of the gathered
// logits, computed in fp32, without gathering them. As cross_entropy's default, a target of
// -100 is ignored (its row adds nothing, and the mean is over the others; no row left: NaN); any
// other target outside [0, V) is refused (UsageError, on every rank of the group).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab_start, const CommPtr& group);

// Rows [V/T] of an embedding whose first global row here is vocab_start: tokens outside this
// slice look up zeros. The caller sums over the group (reduce_from_tp / reduce_scatter_seq).
at::Tensor vocab_slice_embedding(const at::Tensor& tokens, const at::Tensor& weight,
                                 int64_t vocab_start);

}  // namespace dtrain::sharding::tp
