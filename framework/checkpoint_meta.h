// A checkpoint's metadata: meta.json (what Checkpointer::save writes, see checkpoint.h) and
// the COMPLETE marker that holds meta.json's size and checksum, parsed into plain structs.
//
//   parse_complete  COMPLETE's text -> meta.json's FileInfo
//   parse_meta      meta.json's text -> Meta
//   read_meta       <dir>/COMPLETE, then <dir>/meta.json verified against it, parsed
// Every problem raises CheckpointError naming the checkpoint (`where`). Kept apart from
// checkpoint.cc so the parsers can be tested and fuzzed (fuzz/fuzz_checkpoint_meta.cc)
// without a model.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "framework/checkpoint_io.h"

namespace dtrain::framework::ckpt {

// One parameter's slice of an FSDP unit's flat buffer.
struct UnitParamMeta {
  std::string name;
  std::vector<int64_t> shape;
};

// One FSDP unit (sharded checkpoints).
struct UnitMeta {
  int64_t shard_size = 0;  // elements per shard file
  std::vector<UnitParamMeta> params;
};

struct Meta {
  std::string mode;  // full | sharded
  int world_size = 1;
  std::vector<std::string> optimizer_keys;
  std::vector<UnitMeta> units;            // sharded only
  std::vector<int64_t> shard_ranks;       // sharded only: each writing rank's shard rank
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
};

FileInfo parse_complete(const std::string& text, const std::string& where);
Meta parse_meta(const std::string& text, const std::string& where);
// COMPLETE -> meta.json (verified) of the checkpoint directory `dir`.
Meta read_meta(const std::string& dir);

}  // namespace dtrain::framework::ckpt
