// A device mesh: the world laid out as replicate x shard x tp (TorchTitan's
// data_parallel_replicate_degree x data_parallel_shard_degree x tensor_parallel_degree), tp
// innermost, so that a TP group is tp consecutive ranks: one node's, where nodes hold whole
// groups (dtrain-launch numbers a node's ranks consecutively). Each dimension a strategy talks
// over is a communicator split from the world (Communicator::split):
//
//   tp()   the ranks that differ only in their tp coordinate: a layer's slices;
//   dp()   the ranks with this rank's tp coordinate: replicate x shard, over which DDP or FSDP
//          runs as it would over the world (FSDP's hybrid_shard takes shard as its group size).
//
// world rank = (replicate * shard_degree + shard) * tp_degree + tp.
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
  int size() const { return replicate * shard * tp; }
};

class DeviceMesh {
 public:
  // Collective over `world` (its splits). shape.size() must be the world's size.
  DeviceMesh(std::shared_ptr<comm::Communicator> world, MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  int tp_rank() const { return rank_ % shape_.tp; }
  int shard_rank() const { return (rank_ / shape_.tp) % shape_.shard; }
  int replicate_rank() const { return rank_ / (shape_.tp * shape_.shard); }
  int dp_rank() const { return rank_ / shape_.tp; }
  int dp_size() const { return shape_.replicate * shape_.shard; }

  // Null when the dimension has one rank (tp) or the mesh is the world's alone (dp with tp 1:
  // the world itself).
  const std::shared_ptr<comm::Communicator>& tp() const { return tp_; }
  const std::shared_ptr<comm::Communicator>& dp() const { return dp_; }
  const std::shared_ptr<comm::Communicator>& world() const { return world_; }

  // The layout for the log: each dimension, its groups as world ranks, and the nodes a TP
  // group spans.
  std::vector<std::string> describe() const;
  // The TP groups that span more than one node, described ("ranks [2, 3] on nodes 0 and 1");
  // empty when every group is on one node (or the layout is unknown).
  std::string tp_across_nodes() const;

 private:
  std::shared_ptr<comm::Communicator> world_;
  MeshShape shape_;
  int rank_ = 0;
  std::shared_ptr<comm::Communicator> tp_, dp_;
};

}  // namespace dtrain::sharding
