// Checkpoint files written atomically and read back verified.
//
//   PendingFile  a file written as `name.tmp.<pid>` in `dir`, hashed as it is written;
//                commit() fsyncs it, renames it to `name` and fsyncs `dir`: a crash leaves
//                either the old file or the new one, never half of one. Returns the file's
//                size and checksum (xxh64), which the checkpoint's metadata records.
//   write_file   one buffer through a PendingFile.
//   read_file    reads `name` back and refuses it (CheckpointError naming the file) when its
//                size or checksum is not what the metadata recorded: a flipped byte, a
//                truncated file.
//
// Fault injection (core/faults.h): DTRAIN_TEST_CRASH_BEFORE_RENAME=<name> (or <directory>/<name>,
// e.g. step_00000040/meta.json) kills the process (SIGKILL) after that file's temporary copy is
// written and synced, before it is renamed (checkpoint crash tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "framework/checkpoint/hash.h"

namespace dtrain::framework::ckpt {

struct FileInfo {
  std::string name;
  uint64_t bytes = 0;
  uint64_t checksum = 0;  // xxh64
};

class PendingFile {
 public:
  PendingFile(std::string dir, std::string name);
  ~PendingFile();  // without commit(): the temporary file is removed
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;

  void append(const char* data, size_t n);
  FileInfo commit();

 private:
  std::string dir_, name_, path_, tmp_;
  int fd_ = -1;
  uint64_t bytes_ = 0, flushed_ = 0;
  Hasher hash_;
};

FileInfo write_file(const std::string& dir, const std::string& name,
                    const std::vector<char>& bytes);
std::vector<char> read_file(const std::string& dir, const FileInfo& expected);
// Reads without verification (the metadata file itself, whose checksum the marker holds).
std::vector<char> read_raw(const std::string& path);
// fsyncs a directory (after creating or renaming entries in it).
void sync_dir(const std::string& dir);

}  // namespace dtrain::framework::ckpt
