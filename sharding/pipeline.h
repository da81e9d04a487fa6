// The pipeline runtime: one rank's actions of a schedule (sharding/pipeline_schedule.h), run
// in order. Forwards call the caller's stage function; a stage's input that came from another
// rank is a leaf that requires grad, whose gradient the backward sends back. Activations
// travel in `activation_dtype` (the mixed-precision policy's param_dtype) with the shape
// the caller gives, which every receive allocates and each message's header is checked
// against (MPI and Gloo). Backwards accumulate into the stage's parameters' .grad, in
// micro-batch order on every stage. While a trace records (core/trace.h), each forward and
// backward is an event ("forward 2.5": stage 2, micro-batch 5) on the main track, and each
// batch of messages is named by its actions on the communicator's.
//
// clang-format off
//   pp::Pipeline pipe(pp::make_schedule(pp::ScheduleKind::k1F1B, 4, 8), pp_group);
//   pp::Pipeline::Step step;
//   step.forward = [&](int stage, int micro, const at::Tensor& x) { return run_stage(stage, x); };
//   step.loss = [&](int micro, const at::Tensor& y) { return ce(y, targets[micro]) / 8; };
//   step.inputs = token_micro_batches;     // read on stage 0's rank
//   step.activation_shape = {2, 128, 512};
//   auto losses = pipe.run(step);          // the last stage's rank: one loss per micro-batch
// clang-format on
//
// Under zero_bubble a backward runs as two actions: I (sharding/split_backward.h
// backward_input: the input's gradient, which is sent) and W (the parameters' gradients,
// accumulated into .grad as a whole backward would); a W right after a batch of messages runs
// between posting the batch and waiting for it.
//
// A stage whose output needs no gradient (all its parameters frozen, or a run under
// NoGradGuard) runs no backward; the gradient it sends back is zeros. A forward-only schedule
// (ScheduleKind::kForwardOnly: evaluation) runs without a graph and holds nothing.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "sharding/pipeline_schedule.h"

namespace dtrain::sharding::pp {

class Pipeline {
 public:
  // `group`: the pipeline's ranks (its rank r runs the schedule's list r); null for one rank.
  Pipeline(Schedule schedule, std::shared_ptr<comm::Communicator> group);

  struct Step {
    // Stage `stage` on micro-batch `micro`: input is inputs[micro] on stage 0, else the
    // previous stage's output; returns the stage's output (the last stage's goes to `loss`).
    std::function<at::Tensor(int stage, int micro, const at::Tensor& input)> forward;
    // The last stage: the loss to backward for `micro` (scaled as the caller wants).
    std::function<at::Tensor(int micro, const at::Tensor& output)> loss;
    std::vector<at::Tensor> inputs;
    std::vector<int64_t> activation_shape;  // of every stage boundary's activation
    at::ScalarType activation_dtype = at::kFloat;
    // Where receives land: the stages' device (NCCL needs CUDA; MPI and Gloo stage CUDA
    // tensors through the host themselves).
    at::Device device = at::kCPU;
  };

  // Runs this rank's actions once. Returns the last stage's losses (detached), one per
  // micro-batch, on the rank that holds it; empty elsewhere. Throws CommError on a
  // communication failure (the group is then broken).
  std::vector<at::Tensor> run(const Step& step);

  // Agreed across the stages (collective over the group; every rank calls them after run()):
  //   loss_sum     the last stage's losses summed, on every rank (a 0-d double tensor);
  //   any_found_inf  a GradScaler's found-inf flag, 1 on every rank when any stage found one
  //                (each stage unscales its own gradients; all must skip the step together).
  // The gradient norm over all stages is sharding::clip_grad_norm_tensor_ over the group with
  // ShardNorm::kPerRank (each rank's stages' norm, combined once, as TorchTitan does).
  at::Tensor loss_sum(const std::vector<at::Tensor>& losses) const;
  at::Tensor any_found_inf(const at::Tensor& found_inf) const;

  const Schedule& schedule() const { return schedule_; }
  int rank() const { return rank_; }
  // Of the last run: the most micro-batches held at once (activations kept for a backward),
  // and each action's wall time in seconds from the run's start (communication batches as
  // one span named by their first action).
  int peak_in_flight() const { return peak_in_flight_; }
  const std::vector<Span>& spans() const { return spans_; }

  // The message tag of the activation (grad = false) or gradient between stages `boundary`
  // and boundary + 1 for `micro`.
  int tag(int boundary, int micro, bool grad) const;

 private:
  Schedule schedule_;
  std::shared_ptr<comm::Communicator> group_;
  int rank_ = 0;
  int peak_in_flight_ = 0;
  std::vector<Span> spans_;
};

}  // namespace dtrain::sharding::pp
