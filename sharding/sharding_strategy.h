// FSDP's sharding strategies, named once (core/choices.h): the config, the FSDP logs and the
// memory estimate read this table.
#pragma once

#include <array>
#include <utility>

#include "core/choices.h"

namespace dtrain::sharding {

// PyTorch FSDP1's strategies. FULL_SHARD: parameters, gradients and optimizer state sharded,
// parameters re-gathered for backward. SHARD_GRAD_OP: parameters stay gathered from forward
// to the end of backward (less communication, more memory). NO_SHARD: replicated, gradients
// all-reduced (DDP through FSDP's machinery). HYBRID_SHARD: FULL_SHARD within groups of
// hybrid_group_size ranks (one node), replicated across groups.
enum class ShardingStrategy { kFullShard, kShardGradOp, kNoShard, kHybridShard };
inline constexpr std::array<std::pair<ShardingStrategy, const char*>, 4> kShardingStrategies{{
    {ShardingStrategy::kFullShard, "full_shard"},
    {ShardingStrategy::kShardGradOp, "shard_grad_op"},
    {ShardingStrategy::kNoShard, "no_shard"},
    {ShardingStrategy::kHybridShard, "hybrid_shard"},
}};
constexpr const auto& choices(ShardingStrategy) { return kShardingStrategies; }

// Which elements of a unit's parameters each rank of its shard group holds.
//   per_parameter  FSDP2's (fully_shard): every parameter is cut on dim 0 into chunks of
//                  ceil(dim0 / N) rows; rank r holds chunk r of each parameter, zero-padded
//                  to the chunk size. The gradient sums round as fully_shard's do, at any
//                  world size; gathering copies the chunks out into the parameters.
//   flat           FSDP1's FlatParameter: the parameters flattened and concatenated, padded
//                  to a multiple of N, cut into N equal slices. The gathered buffer is the
//                  parameters themselves (no copy), but an element's owner, and so the order
//                  its reduce-scatter adds the ranks' gradients in, differs from
//                  fully_shard's at 3 ranks and more.
enum class ShardLayout { kPerParameter, kFlat };
inline constexpr std::array<std::pair<ShardLayout, const char*>, 2> kShardLayouts{{
    {ShardLayout::kPerParameter, "per_parameter"},
    {ShardLayout::kFlat, "flat"},
}};
constexpr const auto& choices(ShardLayout) { return kShardLayouts; }

}  // namespace dtrain::sharding
