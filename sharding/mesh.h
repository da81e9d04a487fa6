// A device mesh: the world laid out as pp x replicate x shard x tp (TorchTitan's
// pipeline_parallel_degree x data_parallel_replicate_degree x data_parallel_shard_degree x
// tensor_parallel_degree), tp innermost, so that a TP group is tp consecutive ranks: one
// node's, where nodes hold whole groups (dtrain-launch numbers a node's ranks consecutively);
// pp outermost, so that a pipeline's point-to-point messages are the traffic that crosses
// nodes. Each dimension a strategy talks over is a communicator split from the world
// (Communicator::split):
//
//   tp()   the ranks that differ only in their tp coordinate: a layer's slices;
//   dp()   the ranks with this rank's tp and pp coordinates: replicate x shard, over which DDP
//          or FSDP runs as it would over the world (FSDP's hybrid_shard takes shard as its
//          group size);
//   pp()   the ranks that differ only in their pp coordinate: one pipeline's stages.
//
// world rank = ((pp * replicate_degree + replicate) * shard_degree + shard) * tp_degree + tp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace dtrain::sharding {

struct MeshShape {
  int replicate = 1;
  int shard = 1;
  int tp = 1;
  int pp = 1;
  int size() const { return pp * replicate * shard * tp; }
};

class DeviceMesh {
 public:
  // Collective over `world` (its splits). shape.size() must be the world's size.
  DeviceMesh(std::shared_ptr<comm::Communicator> world, MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  int tp_rank() const { return rank_ % shape_.tp; }
  int shard_rank() const { return (rank_ / shape_.tp) % shape_.shard; }
  int replicate_rank() const { return stage_rank() / (shape_.tp * shape_.shard); }
  int dp_rank() const { return stage_rank() / shape_.tp; }
  int dp_size() const { return shape_.replicate * shape_.shard; }
  int pp_rank() const { return rank_ / (shape_.size() / shape_.pp); }

  // Null when the dimension has one rank (tp, pp; dp when it has one and tp or pp more) or
  // the mesh is the world's alone (dp with tp and pp 1: the world itself).
  const std::shared_ptr<comm::Communicator>& tp() const { return tp_; }
  const std::shared_ptr<comm::Communicator>& dp() const { return dp_; }
  const std::shared_ptr<comm::Communicator>& pp() const { return pp_; }
  const std::shared_ptr<comm::Communicator>& world() const { return world_; }

  // The layout for the log: each dimension, its groups as world ranks, and the nodes a TP
  // group spans.
  std::vector<std::string> describe() const;
  // The TP groups that span more than one node, described ("ranks [2, 3] on nodes 0 and 1");
  // empty when every group is on one node (or the layout is unknown).
  std::string tp_across_nodes() const;

 private:
  // This rank's place within its pipeline stage's ranks (replicate x shard x tp).
  int stage_rank() const { return rank_ % (shape_.size() / shape_.pp); }

  std::shared_ptr<comm::Communicator> world_;
  MeshShape shape_;
  int rank_ = 0;
  std::shared_ptr<comm::Communicator> tp_, dp_, pp_;
};

}  // namespace dtrain::sharding
