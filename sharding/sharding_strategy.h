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

}  // namespace dtrain::sharding
