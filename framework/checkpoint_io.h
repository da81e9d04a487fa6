// The files a checkpoint is made of: written atomically, checksummed, read back verified, in
// a format Python's torch.load reads.
//
//   write_file   writes `name.tmp.<pid>` in `dir`, fsyncs it, renames it to `name`, fsyncs
//                `dir`: a crash leaves either the old file or the new one, never half of one.
//                Returns the file's size and checksum (xxh64), which the checkpoint's metadata
//                records.
//   read_file    reads `name` back and refuses it (CheckpointError naming the file) when its
//                size or checksum is not what the metadata recorded: a flipped byte, a
//                truncated file.
//   pickle       torch.save's zip format (data.pkl + one record per tensor) of plain dicts,
//                lists, tuples, strings, numbers and tensors. Unlike torch::pickle_save it
//                writes no TorchScript type tags, so torch.load(weights_only=True) accepts it.
//                Lists of ints and floats are written as generic lists for the same reason.
//   unpickle     reads such files, and torch.save's files from Python (state_dict() with its
//                OrderedDict included).
//
// Fault injection (core/faults.h): DTRAIN_TEST_CRASH_BEFORE_RENAME=<name> (or <directory>/<name>,
// e.g. step_00000040/meta.json) kills the process (SIGKILL) after that file's temporary copy is
// written and synced, before it is renamed (checkpoint crash tests).
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::framework::ckpt {

struct FileInfo {
  std::string name;
  uint64_t bytes = 0;
  uint64_t checksum = 0;  // xxh64
};

// xxHash64 (seed 0), streaming: ~10 GB/s, so checking a checkpoint costs little beside
// reading it. (CRC-32 ran at 2 GB/s here and made writes slower than PyTorch's.)
class Hasher {
 public:
  Hasher();
  void update(const char* data, size_t n);
  uint64_t digest() const;

 private:
  uint64_t v_[4];
  uint64_t total_ = 0;
  unsigned char buffer_[32];
  size_t buffered_ = 0;
};
uint64_t checksum(const char* data, size_t n);
std::string hex(uint64_t v);

FileInfo write_file(const std::string& dir, const std::string& name,
                    const std::vector<char>& bytes);
std::vector<char> read_file(const std::string& dir, const FileInfo& expected);
// Reads without verification (the metadata file itself, whose checksum the marker holds).
std::vector<char> read_raw(const std::string& path);
// fsyncs a directory (after creating or renaming entries in it).
void sync_dir(const std::string& dir);

std::vector<char> pickle(const c10::IValue& value);
// pickle() streamed into a file written as write_file() writes (no copy in memory).
FileInfo write_pickle(const std::string& dir, const std::string& name, const c10::IValue& value);
c10::IValue unpickle(const std::vector<char>& bytes, const std::string& what);

}  // namespace dtrain::framework::ckpt
