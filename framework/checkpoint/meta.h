// A checkpoint's metadata: meta.json (what Checkpointer::save writes, see checkpointer.h) and
// the COMPLETE marker that holds meta.json's size and checksum. This file owns the format:
// its name and version, and a writer and a parser that are each other's inverse
// (parse_meta(write_meta(m)) holds everything m held; meta_test.cc, and the fuzz
// target checks it on every input it accepts).
//
//   write_meta      Meta -> meta.json's text
//   write_complete  meta.json's FileInfo -> COMPLETE's text
//   parse_complete  COMPLETE's text -> meta.json's FileInfo
//   parse_meta      meta.json's text -> Meta
//   read_meta       <dir>/COMPLETE, then <dir>/meta.json verified against it, parsed
// Every problem raises CheckpointError naming the checkpoint (`where`). Kept apart from
// checkpointer.cc so the parsers can be tested and fuzzed (fuzz/fuzz_checkpoint_meta.cc)
// without a model.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "framework/checkpoint/atomic_file.h"
#include "framework/checkpoint/progress.h"

namespace dtrain::framework::ckpt {

inline constexpr const char* kFormat = "dtrain-checkpoint";
inline constexpr int64_t kVersion = 1;

// A model parameter as saved (full checkpoints: its dtype; sharded: the fp32 master's).
struct ParamMeta {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  // comm::dtype_name: fp32, bf16, ...
};

// One parameter of an FSDP unit: where the shard files hold its elements
// (sharding::ParamPlace).
struct UnitParamMeta {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in the unit's parameters flattened and concatenated
  int64_t numel = 0;
  int64_t chunk = 0;     // per_parameter: elements per shard file
  int64_t shard_at = 0;  // per_parameter: where they start in every shard file
  // Tensor parallelism: the dimension this parameter is cut on over the tp ranks (`shape` is
  // one rank's slice); -1: whole on every tp rank.
  int64_t tp_dim = -1;
};

// One FSDP unit (sharded checkpoints).
struct UnitMeta {
  std::string name;
  // per_parameter or flat (sharding::ShardLayout); checkpoints written before the choice
  // existed are flat.
  std::string layout = "flat";
  int64_t numel = 0;       // the unit's parameters, unpadded
  int64_t shard_size = 0;  // elements per shard file
  int64_t shard_group_size = 1;
  std::vector<UnitParamMeta> params;
};

struct Meta {
  std::string strategy;  // the saving run's parallel.strategy (for people; restore reads mode)
  std::string mode;      // full | sharded
  int world_size = 1;
  std::vector<ParamMeta> parameters;
  std::vector<std::string> optimizer_keys;
  std::vector<UnitMeta> units;       // sharded only
  std::vector<int64_t> shard_ranks;  // each writing rank's shard rank
  // Tensor parallelism (sharded checkpoints): the tp degree, and each writing rank's tp rank
  // (whose slices its shard file holds). Absent (tp 1) without it.
  int tp = 1;
  std::vector<int64_t> tp_ranks;
  std::map<std::string, FileInfo> files;  // by name
  // The trainer's state at the save.
  int64_t step = 0;
  int64_t skipped_steps = 0;
  double lr = 0;
  // The trainer's guards, so a resumed run stops where an uninterrupted one would: steps
  // skipped in a row (the scale-collapse guard) and steps with a non-finite loss in a row.
  // Absent from checkpoints written before they were saved: 0.
  int64_t consecutive_skips = 0;
  int64_t nonfinite_run = 0;
  // The loss-spike guard's state. Absent from checkpoints written before it was saved: empty.
  SpikeRecord spike = {};
  // Where the data stood before data step `data_step` (TrainerProgress::data). Absent for data
  // that follows from the step alone, and from checkpoints written before it was kept.
  std::optional<DataPosition> data = std::nullopt;
  int64_t data_step = 0;
  // What the run was trained on, by key (framework/job.h): "data", "tokenizer", "model" and
  // "mesh", each a description a person can read, which a resume compares with its own. Absent
  // from checkpoints written before it was recorded: empty.
  std::map<std::string, std::string> job;
};

std::string write_meta(const Meta& m);
std::string write_complete(const FileInfo& meta);

FileInfo parse_complete(const std::string& text, const std::string& where);
Meta parse_meta(const std::string& text, const std::string& where);
// COMPLETE -> meta.json (verified) of the checkpoint directory `dir`.
Meta read_meta(const std::string& dir);

}  // namespace dtrain::framework::ckpt
