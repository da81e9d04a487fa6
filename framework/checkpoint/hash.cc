#include "framework/checkpoint/hash.h"

#include <cstdio>
#include <cstring>

namespace dtrain::framework::ckpt {
namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full,
                   kP3 = 0x165667B19E3779F9ull, kP4 = 0x85EBCA77C2B2AE63ull,
                   kP5 = 0x27D4EB2F165667C5ull;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint64_t round64(uint64_t acc, uint64_t input) { return rotl(acc + input * kP2, 31) * kP1; }
uint64_t merge(uint64_t acc, uint64_t v) { return (acc ^ round64(0, v)) * kP1 + kP4; }

}  // namespace

Hasher::Hasher() : v_{kP1 + kP2, kP2, 0, 0 - kP1} {}

void Hasher::update(const char* data, size_t n) {
  if (n == 0) return;  // an empty tensor's data pointer may be null, which memcpy must not see
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  total_ += n;
  if (buffered_ + n < 32) {
    std::memcpy(buffer_ + buffered_, p, n);
    buffered_ += n;
    return;
  }
  if (buffered_ > 0) {
    const size_t fill = 32 - buffered_;
    std::memcpy(buffer_ + buffered_, p, fill);
    for (int i = 0; i < 4; ++i) v_[i] = round64(v_[i], read64(buffer_ + 8 * i));
    p += fill;
    n -= fill;
    buffered_ = 0;
  }
  while (n >= 32) {
    for (int i = 0; i < 4; ++i) v_[i] = round64(v_[i], read64(p + 8 * i));
    p += 32;
    n -= 32;
  }
  std::memcpy(buffer_, p, n);
  buffered_ = n;
}

uint64_t Hasher::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    for (int i = 0; i < 4; ++i) h = merge(h, v_[i]);
  } else {
    h = v_[2] + kP5;  // the seed (0) + P5
  }
  h += total_;
  const unsigned char* p = buffer_;
  size_t n = buffered_;
  for (; n >= 8; p += 8, n -= 8) h = rotl(h ^ round64(0, read64(p)), 27) * kP1 + kP4;
  if (n >= 4) {
    uint32_t k;
    std::memcpy(&k, p, 4);
    h = rotl(h ^ (static_cast<uint64_t>(k) * kP1), 23) * kP2 + kP3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; ++p, --n) h = rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t checksum(const char* data, size_t n) {
  Hasher h;
  h.update(data, n);
  return h.digest();
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace dtrain::framework::ckpt
