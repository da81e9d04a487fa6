// Trainer: the dtype-agnostic training loop, driven by a RunConfig.
//
// Per step: zero_grad(set_to_none) -> for each micro-batch (all but the last under DDP's
// no_sync): forward under autocast (the policy's param_dtype; off for fp32) -> loss /
// micro_batches -> scaler.scale(loss).backward() -> scaler.unscale_ -> clip_grad_norm_ ->
// scaler.step (skipped on inf/NaN) -> scaler.update -> LR schedule (linear warmup, cosine
// to 10%). One loop serves fp32, bf16 and fp16: a disabled GradScaler passes through.
//
// Every logging.every_steps it logs loss (mean over ranks), loss scale, gradient norm,
// skipped steps, tokens/s, step time and peak memory, writes the same as a JSON line to
// logging.metrics_file (rank 0), and redraws a progress bar on rank 0's terminal.
//
// Strategies: none (one process), ddp (autocast in param_dtype, reduce in reduce_dtype), fsdp
// (sharded parameters in param_dtype, the ShardedGradScaler for fp16, clipping over shards).
//
// Not yet here, and refused with a clear ConfigError rather than ignored: checkpoint.dir
// (checkpoints come with resume).
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "framework/config.h"

namespace dtrain::framework {

struct TrainResult {
  int64_t steps = 0;
  int64_t skipped_steps = 0;
  double first_loss = 0;  // mean over ranks, first logged step
  double last_loss = 0;   // mean over ranks, last step
  double final_scale = 1;
};

// Trains as configured. `comm` may be null for strategy none on one process.
TrainResult train(const RunConfig& config, std::shared_ptr<comm::Communicator> comm);

}  // namespace dtrain::framework
