// meta.json's writer and parser are each other's inverse: a Meta with every field set (names
// that need escaping, a sharded layout, an lr that needs all 17 digits) comes back from
// parse_meta(write_meta(m)) field for field, and so does COMPLETE. A damaged field is refused
// by name.
#include "framework/checkpoint/meta.h"

#include <gtest/gtest.h>

#include <array>
#include <string>
#include <vector>

#include "core/error.h"

namespace dtrain::framework::ckpt {
namespace {

Meta sharded_meta() {
  Meta m;
  m.strategy = "fsdp";
  m.mode = "sharded";
  m.world_size = 3;
  m.parameters = {{"blocks.0.\"odd\"\\name\n", {4, 2}, "fp32"}, {"bias", {}, "fp32"}};
  m.optimizer_keys = {"exp_avg", "exp_avg_sq"};
  // At 3 ranks: per_parameter cuts the [4, 2] weight into chunks of 2 rows (4 elements) and
  // gives the 0-dim bias a chunk of 1 after it; flat cuts the 9 elements into slices of 3.
  m.units = {{"blocks.0",
              "per_parameter",
              9,
              5,
              3,
              {{"blocks.0.\"odd\"\\name\n", {4, 2}, 0, 8, 4, 0}, {"bias", {}, 8, 1, 1, 4}}},
             {"blocks.1", "flat", 9, 3, 3, {{"w", {4, 2}, 0, 8}, {"b", {}, 8, 1}}},
             {"", "flat", 0, 1, 1, {}}};
  m.shard_ranks = {0, 1, 2};
  m.files = {{"shard_00000.pt", {"shard_00000.pt", 123, 0xfedcba9876543210ULL}},
             {"rank_00002.pt", {"rank_00002.pt", 7, 1}}};
  m.step = 40;
  m.skipped_steps = 3;
  m.lr = 0.1 + 0.2;  // 0.30000000000000004: every digit must survive
  m.consecutive_skips = 2;
  m.nonfinite_run = 1;
  m.spike.history = {{37, 2.5}, {39, 0.1 + 0.7}, {40, 1e-300}};
  m.spike.streak = 1;
  m.spike.streak_start = 38;
  m.spike.skipped_batches = {3, 4, 17};
  m.spike.spikes = {{4, 5}, {18, 18}};
  m.data = DataPosition{2, 41};
  m.data_step = 77;
  m.job = {{"data", "corpus \"a.txt\" (12 bytes, xxh64 0123)"}, {"mesh", "3 rank(s)"}};
  return m;
}

void expect_same(const Meta& a, const Meta& b) {
  EXPECT_EQ(a.strategy, b.strategy);
  EXPECT_EQ(a.mode, b.mode);
  EXPECT_EQ(a.world_size, b.world_size);
  ASSERT_EQ(a.parameters.size(), b.parameters.size());
  for (size_t i = 0; i < a.parameters.size(); ++i) {
    EXPECT_EQ(a.parameters[i].name, b.parameters[i].name);
    EXPECT_EQ(a.parameters[i].shape, b.parameters[i].shape);
    EXPECT_EQ(a.parameters[i].dtype, b.parameters[i].dtype);
  }
  EXPECT_EQ(a.optimizer_keys, b.optimizer_keys);
  ASSERT_EQ(a.units.size(), b.units.size());
  for (size_t u = 0; u < a.units.size(); ++u) {
    EXPECT_EQ(a.units[u].name, b.units[u].name);
    EXPECT_EQ(a.units[u].layout, b.units[u].layout);
    EXPECT_EQ(a.units[u].numel, b.units[u].numel);
    EXPECT_EQ(a.units[u].shard_size, b.units[u].shard_size);
    EXPECT_EQ(a.units[u].shard_group_size, b.units[u].shard_group_size);
    ASSERT_EQ(a.units[u].params.size(), b.units[u].params.size());
    for (size_t i = 0; i < a.units[u].params.size(); ++i) {
      EXPECT_EQ(a.units[u].params[i].name, b.units[u].params[i].name);
      EXPECT_EQ(a.units[u].params[i].shape, b.units[u].params[i].shape);
      EXPECT_EQ(a.units[u].params[i].offset, b.units[u].params[i].offset);
      EXPECT_EQ(a.units[u].params[i].numel, b.units[u].params[i].numel);
      EXPECT_EQ(a.units[u].params[i].chunk, b.units[u].params[i].chunk);
      EXPECT_EQ(a.units[u].params[i].shard_at, b.units[u].params[i].shard_at);
      EXPECT_EQ(a.units[u].params[i].tp_dim, b.units[u].params[i].tp_dim);
    }
  }
  EXPECT_EQ(a.shard_ranks, b.shard_ranks);
  EXPECT_EQ(a.tp, b.tp);
  EXPECT_EQ(a.tp_ranks, b.tp_ranks);
  ASSERT_EQ(a.files.size(), b.files.size());
  for (const auto& [name, f] : a.files) {
    ASSERT_TRUE(b.files.count(name)) << name;
    EXPECT_EQ(b.files.at(name).name, f.name);
    EXPECT_EQ(b.files.at(name).bytes, f.bytes);
    EXPECT_EQ(b.files.at(name).checksum, f.checksum);
  }
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.skipped_steps, b.skipped_steps);
  EXPECT_EQ(a.lr, b.lr);  // bitwise
  EXPECT_EQ(a.consecutive_skips, b.consecutive_skips);
  EXPECT_EQ(a.nonfinite_run, b.nonfinite_run);
  EXPECT_EQ(a.spike.history, b.spike.history);  // the losses bitwise
  EXPECT_EQ(a.spike.streak, b.spike.streak);
  EXPECT_EQ(a.spike.streak_start, b.spike.streak_start);
  EXPECT_EQ(a.spike.skipped_batches, b.spike.skipped_batches);
  EXPECT_EQ(a.spike.spikes, b.spike.spikes);
  ASSERT_EQ(a.data.has_value(), b.data.has_value());
  if (a.data) {
    EXPECT_EQ(a.data->epoch, b.data->epoch);
    EXPECT_EQ(a.data->position, b.data->position);
  }
  EXPECT_EQ(a.data_step, b.data_step);
  EXPECT_EQ(a.job, b.job);
}

TEST(CheckpointMeta, ParseInvertsWriteForAShardedCheckpoint) {
  const Meta m = sharded_meta();
  const std::string text = write_meta(m);
  expect_same(m, parse_meta(text, "test/meta.json"));
  EXPECT_EQ(write_meta(parse_meta(text, "test/meta.json")), text);
}

// Under tensor parallelism: the tp degree, each rank's tp rank, and each parameter's cut.
TEST(CheckpointMeta, ParseInvertsWriteUnderTensorParallelism) {
  Meta m = sharded_meta();
  m.tp = 3;
  m.tp_ranks = {0, 1, 2};
  m.units[1].params[0].tp_dim = 1;
  const std::string text = write_meta(m);
  expect_same(m, parse_meta(text, "test/meta.json"));
  EXPECT_EQ(write_meta(parse_meta(text, "test/meta.json")), text);
  // A tp rank the degree does not have, and a 0-dim parameter cut, are refused.
  std::string bad = text;
  bad.replace(bad.find("\"tp_ranks\": [0, 1, 2]"), 21, "\"tp_ranks\": [0, 1, 3]");
  EXPECT_THROW(parse_meta(bad, "test/meta.json"), CheckpointError);
  m.units[1].params[1].tp_dim = 0;
  EXPECT_THROW(parse_meta(write_meta(m), "test/meta.json"), CheckpointError);
}

TEST(CheckpointMeta, ParseInvertsWriteForAFullCheckpoint) {
  Meta m = sharded_meta();
  m.mode = "full";
  m.strategy = "ddp";
  m.units.clear();  // a full checkpoint has none, and the writer writes none
  m.parameters[1].dtype = "bf16";
  expect_same(m, parse_meta(write_meta(m), "test/meta.json"));
}

TEST(CheckpointMeta, CompleteRoundTrips) {
  const FileInfo meta{"meta.json", 4567, 0x0123456789abcdefULL};
  const FileInfo back = parse_complete(write_complete(meta), "test/COMPLETE");
  EXPECT_EQ(back.name, meta.name);
  EXPECT_EQ(back.bytes, meta.bytes);
  EXPECT_EQ(back.checksum, meta.checksum);
}

TEST(CheckpointMeta, ADamagedFieldIsRefusedByName) {
  std::string text = write_meta(sharded_meta());
  const std::string from = "\"shard_group_size\": 3";
  text.replace(text.find(from), from.size(), "\"shard_group_size\": \"three\"");
  try {
    parse_meta(text, "test/meta.json");
    FAIL() << "a damaged meta.json was accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("units[0].shard_group_size"), std::string::npos)
        << e.what();
  }
  // A chunk that does not fit its files, and a layout nobody writes, are named too.
  for (const auto& [from_text, to_text, key] : std::vector<std::array<std::string, 3>>{
           {"\"chunk\": 4", "\"chunk\": 2", "units[0].params[0].chunk"},
           {"\"shard_at\": 4", "\"shard_at\": 5", "units[0].params[1].shard_at"},
           {"\"layout\": \"flat\"", "\"layout\": \"diagonal\"", "units[1].layout"}}) {
    std::string bad = write_meta(sharded_meta());
    bad.replace(bad.find(from_text), from_text.size(), to_text);
    try {
      parse_meta(bad, "test/meta.json");
      FAIL() << "accepted " << to_text;
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
  // Written before the layout was recorded: flat.
  std::string old = write_meta(sharded_meta());
  const std::string layout = "\"layout\": \"flat\", ";
  old.replace(old.find(layout), layout.size(), "");
  EXPECT_EQ(parse_meta(old, "test/meta.json").units[1].layout, "flat");
  std::string other = write_meta(sharded_meta());
  other.replace(other.find("dtrain-checkpoint"), 17, "someone-elses-fmt");
  EXPECT_THROW(parse_meta(other, "test/meta.json"), CheckpointError);
}

}  // namespace
}  // namespace dtrain::framework::ckpt
