// xxHash64 (seed 0) for checkpoint files: every file's checksum in meta.json, and the
// parameter digests the trainer compares across ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::framework::ckpt {

// Streaming: ~10 GB/s, so checking a checkpoint costs little beside reading it. (CRC-32 ran at
// 2 GB/s here and made writes slower than PyTorch's.)
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
// 16 lowercase hex digits.
std::string hex(uint64_t v);

}  // namespace dtrain::framework::ckpt
