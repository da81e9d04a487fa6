#include "sharding/mesh.h"

#include <set>

#include "core/error.h"

namespace dtrain::sharding {
namespace {

std::string ranks_text(const std::vector<int>& r) {
  std::string out = "[";
  for (size_t i = 0; i < r.size(); ++i) out += (i ? ", " : "") + std::to_string(r[i]);
  return out + "]";
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<comm::Communicator> world, MeshShape shape)
    : world_(std::move(world)), shape_(shape) {
  const int size = world_ ? world_->size() : 1;
  rank_ = world_ ? world_->rank() : 0;
  DTRAIN_CHECK_AS(ConfigError,
                  shape_.replicate >= 1 && shape_.shard >= 1 && shape_.tp >= 1 && shape_.pp >= 1,
                  "the mesh's degrees must be >= 1, got pp ", shape_.pp, " x replicate ",
                  shape_.replicate, " x shard ", shape_.shard, " x tp ", shape_.tp);
  DTRAIN_CHECK_AS(ConfigError, shape_.size() == size, "the mesh pp ", shape_.pp, " x replicate ",
                  shape_.replicate, " x shard ", shape_.shard, " x tp ", shape_.tp, " = ",
                  shape_.size(), " ranks, but the job has ", size);
  if (!world_ || size == 1) return;
  // Every rank splits the same ones, in the same order: collectives over the world.
  if (shape_.tp > 1) tp_ = world_->split(/*color=*/rank_ / shape_.tp, /*key=*/tp_rank());
  if (shape_.tp == 1 && shape_.pp == 1) {
    dp_ = world_;
  } else if (dp_size() > 1) {
    dp_ = world_->split(/*color=*/pp_rank() * shape_.tp + tp_rank(), /*key=*/dp_rank());
  }
  if (shape_.pp > 1) pp_ = world_->split(/*color=*/stage_rank(), /*key=*/pp_rank());
}

std::vector<std::string> DeviceMesh::describe() const {
  const int size = shape_.size();
  std::vector<std::string> out;
  out.push_back((shape_.pp > 1 ? "mesh: pp " + std::to_string(shape_.pp) + " x replicate "
                               : std::string("mesh: replicate ")) +
                std::to_string(shape_.replicate) + " x shard " + std::to_string(shape_.shard) +
                " x tp " + std::to_string(shape_.tp) + " = " + std::to_string(size) +
                " rank(s), tp innermost");
  const std::vector<int>* nodes =
      world_ && world_->world_nodes().size() == static_cast<size_t>(size) ? &world_->world_nodes()
                                                                          : nullptr;
  if (shape_.tp > 1) {
    std::string groups;
    for (int g = 0; g < size / shape_.tp; ++g) {
      std::vector<int> r;
      std::set<int> on;
      for (int t = 0; t < shape_.tp; ++t) {
        r.push_back(g * shape_.tp + t);
        if (nodes) on.insert((*nodes)[g * shape_.tp + t]);
      }
      std::string where;
      if (nodes) {
        where = " on node";
        where += on.size() > 1 ? "s" : "";
        for (int n : on) where += " " + std::to_string(n);
      }
      groups += (groups.empty() ? "" : ", ") + ranks_text(r) + where;
    }
    out.push_back("mesh: tp groups " + groups);
  }
  const int per_stage = size / shape_.pp;
  if (dp_size() > 1) {
    std::string groups;
    for (int p = 0; p < shape_.pp; ++p) {
      for (int t = 0; t < shape_.tp; ++t) {
        std::vector<int> r;
        for (int d = 0; d < dp_size(); ++d) r.push_back(p * per_stage + d * shape_.tp + t);
        groups += (groups.empty() ? "" : ", ") + ranks_text(r);
      }
    }
    out.push_back("mesh: data-parallel groups (replicate x shard) " + groups);
  }
  if (shape_.pp > 1) {
    std::string groups;
    for (int s = 0; s < per_stage; ++s) {
      std::vector<int> r;
      for (int p = 0; p < shape_.pp; ++p) r.push_back(p * per_stage + s);
      groups += (groups.empty() ? "" : ", ") + ranks_text(r);
    }
    out.push_back("mesh: pipelines (pp groups, stage 0 first) " + groups);
  }
  return out;
}

std::string DeviceMesh::tp_across_nodes() const {
  const int size = shape_.size();
  if (!world_ || shape_.tp == 1 || world_->world_nodes().size() != static_cast<size_t>(size)) {
    return "";
  }
  const auto& nodes = world_->world_nodes();
  std::string out;
  for (int g = 0; g < size / shape_.tp; ++g) {
    std::set<int> on;
    std::vector<int> r;
    for (int t = 0; t < shape_.tp; ++t) {
      on.insert(nodes[g * shape_.tp + t]);
      r.push_back(g * shape_.tp + t);
    }
    if (on.size() > 1) {
      std::string n;
      for (int x : on) n += (n.empty() ? "" : ", ") + std::to_string(x);
      out += (out.empty() ? "" : "; ") + ranks_text(r) + " on nodes " + n;
    }
  }
  return out;
}

}  // namespace dtrain::sharding
