// Fuzzes a checkpoint's metadata parsers (framework/checkpoint/meta.h), which restore runs
// on a checkpoint directory before anything else: parse_complete (the COMPLETE marker ->
// meta.json's size and checksum) and parse_meta (meta.json -> files, mode, world size, FSDP
// units, shard ranks, trainer state).
//
// Input: with a '\0', the bytes before it are COMPLETE's text and the rest meta.json's;
// without one, the whole input is meta.json's. Each is parsed on its own (the checksum
// between them is read_meta's business, tested in checkpoint_test).
// Any input must end in a result or a dtrain::Error (CheckpointError); anything else
// escaping, a crash, a hang or a sanitizer report is a bug. An accepted meta.json must survive
// write_meta and parse_meta unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "core/error.h"
#include "framework/checkpoint/meta.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input = dtrain::fuzz::text(data, size);
  const bool has_complete = input.find('\0') != std::string::npos;
  const auto [complete, meta] = has_complete ? dtrain::fuzz::split_nul(input)
                                             : std::pair<std::string, std::string>{"", input};
  if (has_complete) {
    try {
      dtrain::framework::ckpt::parse_complete(complete, "fuzz/COMPLETE");
      dtrain::fuzz::report("accepted");
    } catch (const dtrain::Error& e) {
      dtrain::fuzz::report(e.what());
      // Refused: what a user sees. Anything else propagates and aborts.
    }
  }
  namespace ckpt = dtrain::framework::ckpt;
  std::optional<ckpt::Meta> parsed;
  try {
    parsed = ckpt::parse_meta(meta, "fuzz/meta.json");
    dtrain::fuzz::report("accepted");
  } catch (const dtrain::Error& e) {
    dtrain::fuzz::report(e.what());
  }
  if (parsed) {
    // The writer is the parser's inverse: what was accepted is written and read back to the
    // same text (a field the writer dropped or garbled changes it; a CheckpointError here
    // escapes and aborts, as it should).
    const std::string once = ckpt::write_meta(*parsed);
    const std::string twice = ckpt::write_meta(ckpt::parse_meta(once, "fuzz/rewritten"));
    if (once != twice) std::abort();
  }
  return 0;
}
