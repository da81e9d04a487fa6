// What a run will need per rank, estimated from its config before anything is allocated, and
// the guard that refuses a run that cannot fit.
//
// On Linux a real out-of-memory is the kernel's OOM killer, which may take other processes
// down with it: dtrain never provokes it. Before the model is built, the trainer sets the
// estimate times the ranks on this node against the memory the system has available and
// stops with an error that gives the estimate and what to change (fsdp, a smaller batch,
// bf16).
//
// The estimate (host memory, CPU runs; a CUDA run's device memory is not checked here):
//   parameters   fp32 masters (DDP: the module's own; FSDP: 1/N shards)
//   gradients    fp32 (FSDP: 1/N, or the reduce dtype with keep_low_precision_grads); DDP's
//                16-bit reduce adds a comm copy
//   optimizer    AdamW 2 fp32 tensors per parameter, SGD with momentum 1 (FSDP: 1/N)
//   compute      low-precision copies: autocast's weight cache (DDP), gathered units in
//                param_dtype (FSDP: limit_all_gathers blocks plus the root under FULL_SHARD,
//                every unit under SHARD_GRAD_OP) and the gradient buffer of one unit
//   activations  the model's own formula (its registration, framework/model_registry.h):
//                the TransformerLM's per token is layers x (18 d_model-wide values in the
//                compute dtype + heads x seq_len attention probabilities in fp32, and in the
//                compute dtype when it is 16-bit) + the logits, within 1% of the tracked bytes
//                of a measured fp32 step at d_model 128 and 512 (memory_estimate_test,
//                step_bench); a recomputed block (model.recompute) keeps its input plus one
//                block's activations while it is recomputed
//   construction the full fp32 model, before FSDP shards it; a model FSDP builds deferred
//                (the transformer, llama) holds its shards and one unit's fp32 buffer instead
//   pipeline     (parallel.pp > 1) each rank's stages' parameters, gradients and optimizer
//                state, and the activations of as many micro-batches as its schedule holds at
//                once (Schedule::promised_in_flight); the estimate is the largest rank's, and
//                while a full checkpoint is staged rank 0 holds the whole model and its
//                optimizer state (the construction peak covers it)
// It is an estimate: the allocator's slack, libraries and threads come on top.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "framework/config.h"

namespace dtrain::framework {

struct MemoryEstimate {
  double parameters = 0, gradients = 0, optimizer = 0, compute = 0, activations = 0;
  double construction = 0;  // transient peak while the model is built and sharded
  // checkpoint.async: the host copy of what this rank writes, kept between saves.
  double checkpoint_staging = 0;
  int64_t parameter_count = 0;
  double steady() const { return parameters + gradients + optimizer; }
  // The larger of the training peak and the construction peak, in bytes.
  double peak() const;
  std::string describe() const;  // "3.20 GiB (parameters 1.00 GiB, gradients ...)"
};

// "812.3 MiB", "3.20 GiB".
std::string format_bytes(double bytes);

// Per rank, for `world` ranks with the config's strategy (the largest rank's under a pipeline).
MemoryEstimate estimate_memory(const RunConfig& c, int world);

// Under a pipeline (parallel.pp > 1): per pipeline rank, its stages' layers ("layers 0-3")
// and its estimate.
struct StageEstimate {
  std::string holds;
  int in_flight = 0;  // micro-batches whose activations it holds at most
  MemoryEstimate memory;
};
std::vector<StageEstimate> estimate_pipeline_ranks(const RunConfig& c, int world);

// Bytes the system can give new allocations now (MemAvailable), or -1 when unknown.
int64_t available_memory_bytes();

// `dtrain-train --estimate`: the estimate's terms per rank for `world` ranks, activations
// with and without recompute, what `ranks_here` ranks need of `available` bytes (< 0:
// unknown), and the deepest model of the same width that fits (n_layers, or the MLP's
// depth), as DeepSpeed's estimate_zero3_model_states_mem_needs answers for ZeRO-3.
std::string estimate_report(const RunConfig& c, int world, int ranks_here, int64_t available);

// The deepest model of this config's width whose ranks_here ranks fit in 90% of `available`
// (0: not even one layer).
int64_t deepest_that_fits(const RunConfig& c, int world, int ranks_here, int64_t available);

// Throws ConfigError when `ranks_here` ranks of this estimate exceed 90% of `available`
// bytes (< 0: unknown, no check), naming the estimate and the choices that would fit.
void check_memory_fits(const RunConfig& c, int world, int ranks_here, int64_t available);

}  // namespace dtrain::framework
