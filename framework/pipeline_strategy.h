// PipelineStrategy: the trainer's pipeline parallelism (parallel.pp > 1; docs/pipeline.md).
// The model's layers are split into pp x pp_stages_per_rank stages (sharding/pipeline_schedule.h
// split_layers), stage s on pipeline rank s % pp, and each optimizer step's micro-batches run
// through them under the configured schedule (sharding/pipeline.h). The mesh is pp x
// (data-parallel ranks), pp outermost (sharding/mesh.h): after the schedule, each stage's
// gradients are averaged over its data-parallel ranks in one coalesced all-reduce in
// reduce_dtype, as DDP's would be (no_sync for all but the last micro-batch).
//
// What each rank holds: its own stages' parameters (the first stage's rank the embedding, the
// last stage's the final norm and the head), made as one process makes them (a deferred
// model's initializer, or the whole model built from the same seed and the rest dropped). The
// others are empty tensors, which share() fills with their owners' values where a checkpoint
// or an export needs the whole model. Only the own stages' parameters get gradients, optimizer
// state and steps. Activations cross stage boundaries in the policy's param_dtype under autocast
// (fp32 otherwise); a receiving stage computes on in fp32, as the residual stream of one process
// does.
//
// Under parallel.strategy fsdp the data-parallel ranks of a stage shard its parameters, their
// gradients and their optimizer state (FSDP's shards, sharding/flat.h place_params, in the
// configured shard_layout): between steps each of its own parameters holds this rank's 1-D
// shard (the fp32 master, which the optimizer steps). A step gathers the stage's parameters
// once (one all-gather), runs every micro-batch on them, and reduce-scatters the accumulated
// gradients once: TorchTitan's FSDP under a pipeline, with no re-gather per micro-batch (what
// FSDP2's reshard_after_forward=False gives it). A checkpoint or an export gathers the stage
// and its optimizer state whole first (share), and drop_foreign_state shards them again.
//
// Agreed over the pipeline (collective over its ranks): the loss (the last stage's, on every
// rank), the gradient norm (per parameter over the pipeline, then over the parameters in the
// model's order: one process's norm; with shards, per parameter over them too, as FSDP's), and
// a GradScaler's found-inf flag (the trainer's ShardedGradScaler over the world).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "framework/config.h"
#include "framework/data.h"
#include "framework/strategy.h"
#include "sharding/deferred_init.h"
#include "sharding/flat.h"
#include "sharding/mesh.h"
#include "sharding/pipeline.h"

namespace torch::optim {
class Optimizer;
}

namespace dtrain::framework {

// What the pipeline needs of a model: its layers, how to run a range of them, and which layer
// each parameter belongs to.
struct PipelineModel {
  std::shared_ptr<torch::nn::Module> module;
  int64_t layers = 0;
  int64_t hidden = 0;  // the last dimension of the activation between layers
  // Layers [begin, end) on x: tokens in when begin is 0 (the embedding first), the logits out
  // when end is `layers` (the final norm and the head last), else the hidden states.
  std::function<at::Tensor(const at::Tensor& x, int64_t begin, int64_t end)> forward;
  // A parameter's or buffer's layer by its name: -1 before the first (the embedding),
  // `layers` after the last (the norm and the head).
  std::function<int64_t(const std::string& name)> layer_of;
  // A model built deferred (sharding/deferred_init.h: its parameters placeholders): each rank
  // makes its own stages' parameters with this, so none ever holds the whole model. Null: the
  // module was built whole.
  sharding::ParamInit init;
};

class PipelineStrategy final : public Strategy {
 public:
  // Collective over nothing: `mesh` has the pipeline (mesh->pp()) and data-parallel groups.
  PipelineStrategy(PipelineModel model, std::shared_ptr<sharding::DeviceMesh> mesh,
                   const RunConfig& c);

  // The whole model's output for `inputs` on every rank of the pipeline: a forward-only run of
  // one micro-batch, the last stage's output broadcast (sampling). Collective over the pipeline.
  at::Tensor forward(const at::Tensor& inputs) override;
  // Every parameter of the model (the optimizer holds them all; only this rank's stages' get
  // gradients, so only they are stepped; sharded, as their 1-D shards).
  std::vector<at::Tensor> parameters() override { return model_.module->parameters(); }
  torch::nn::Module& module() override { return *model_.module; }
  PipelineStrategy* pipeline() override { return this; }
  at::Tensor clip_grad_norm(double max_norm) override;

  // One optimizer step's forwards and backwards over `batches` (train.micro_batches of them;
  // every rank of a pipeline is given the same ones, which its first and last stage read), under
  // the schedule. `loss(m, output)` is micro-batch m's loss as logged; `scale(loss)` is what
  // backward starts from (a GradScaler's scaled loss). Then each stage's gradients averaged
  // over its data-parallel ranks. Returns the losses' sum on every rank (a 0-d double tensor).
  using LossOf = std::function<at::Tensor(int micro, const at::Tensor& output)>;
  at::Tensor train(const std::vector<Batch>& batches, const LossOf& loss,
                   const std::function<at::Tensor(const at::Tensor&)>& scale);
  // `reduce(output)` of the whole model's output for `inputs` (a forward-only run), on every
  // rank of the pipeline (a 0-d double tensor): the validation loss's sum, computed on the
  // last stage without moving the logits.
  at::Tensor evaluate(const at::Tensor& inputs,
                      const std::function<at::Tensor(const at::Tensor& output)>& reduce);

  // Every parameter's and buffer's value from its owner (the rank of its stage), and with
  // `optimizer` its optimizer state too: afterwards every rank holds the whole model and its
  // whole optimizer state, as one process would (what an export or the end-of-run check reads).
  // Collective over the pipeline. `to_first`: only the first pipeline's first rank receives them
  // (world rank 0, which writes a full checkpoint; the other pipelines do nothing).
  // drop_foreign_state() frees the other ranks' stages' parameters and optimizer state again (after
  // a checkpoint is staged or restored; sharded, it shards the own stages' again); hold_whole(true)
  // makes every parameter whole-sized (a restore reads into them). Collective over the
  // data-parallel ranks when the stages are sharded (share, drop_foreign_state).
  void share(torch::optim::Optimizer* optimizer, bool to_first = false);
  void drop_foreign_state(torch::optim::Optimizer& optimizer);
  void hold_whole(bool whole);

  const sharding::pp::Schedule& schedule() const { return pipe_.schedule(); }
  int pp_rank() const { return pipe_.rank(); }
  // The log's lines: each stage's layers and its ranks.
  std::vector<std::string> describe() const;
  // Of the last training step: the most micro-batches this rank held at once.
  int peak_in_flight() const { return pipe_.peak_in_flight(); }
  // parallel.strategy fsdp over more than one data-parallel rank.
  bool sharded() const { return shards_ != nullptr; }

 private:
  // Sharding (parallel.strategy fsdp). unshard: every own parameter whole (an all-gather over
  // the data-parallel ranks), and with `optimizer` its state too; reshard: back to this rank's
  // shards (no communication: every rank holds the whole values). The parameters and the
  // state each move only when they are not so already (tracked apart).
  void unshard(torch::optim::Optimizer* optimizer);
  void reshard(torch::optim::Optimizer* optimizer);
  // Every data-parallel rank's shards of the own parameters (`shards[k]` of own_[k]; undefined:
  // none) as whole tensors of their shapes: one all-gather.
  std::vector<at::Tensor> gather_shards(const std::vector<at::Tensor>& shards) const;
  // This rank's part of own_[k]'s whole value (a 1-D copy).
  at::Tensor shard_of(size_t k, const at::Tensor& whole) const;
  // The own parameters' gradients, averaged over the data-parallel ranks and scattered: each
  // rank's shard of them (one reduce-scatter in reduce_dtype), the parameters resharded.
  void reduce_scatter_grads();
  // For each of params[which[k]]: whether any rank of `group` has its gradient (collective:
  // one all-reduce of a flag per parameter).
  static std::vector<bool> any_rank_has_grad(comm::Communicator& group,
                                             const std::vector<at::Tensor>& params,
                                             const std::vector<size_t>& which);

  at::Tensor run_stage(int stage, const at::Tensor& input) const;
  // One forward-only run of `inputs` through the stages (the own ones gathered when sharded);
  // the last stage's rank hands the output to `at_last`.
  void forward_only(const at::Tensor& inputs,
                    const std::function<void(const at::Tensor&)>& at_last);
  std::vector<int64_t> activation_shape(const at::Tensor& tokens) const;
  int owner_of(size_t param) const { return owner_[param]; }
  at::Device device() const;

  PipelineModel model_;
  std::shared_ptr<sharding::DeviceMesh> mesh_;
  const RunConfig& c_;
  sharding::pp::Pipeline pipe_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // per stage: its layers [begin, end)
  at::ScalarType activation_dtype_ = at::kFloat;
  std::vector<int> owner_;         // per parameter (module order): the pipeline rank of its stage
  std::vector<int> buffer_owner_;  // the same per buffer
  std::vector<std::vector<int64_t>> shapes_;  // per parameter: its whole shape
  // Sharding: the data-parallel group (null: not sharded), the own parameters' indices and
  // their places in every rank's shard of shard_size_ elements, and whether they hold shards
  // now. norm_group_: the ranks over which a parameter's norm combines (pipeline x shards).
  comm::Communicator* shards_ = nullptr;
  sharding::ShardLayout layout_ = sharding::ShardLayout::kPerParameter;
  std::vector<size_t> own_;
  std::vector<sharding::ParamPlace> places_;
  int64_t shard_size_ = 0;
  bool holds_shards_ = false;
  // The optimizer's state of the own parameters is shard-shaped (kept apart from
  // holds_shards_: a restore holds the parameters whole while the state stays sharded).
  bool state_sharded_ = false;
  std::shared_ptr<comm::Communicator> norm_group_;
};

}  // namespace dtrain::framework
