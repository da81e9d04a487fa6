// Tracked tensor memory on the CPU: a counting wrapper around c10's CPU allocator, so
// benchmarks, tests and the trainer can report the bytes tensors actually hold (current and
// peak), beside the process RSS high-water mark that also counts the allocator's caches,
// code and libraries. (CUDA has its own statistics in c10's caching allocator.)
//
// install() must run before the tensors to be counted are allocated; tensors allocated
// earlier are freed through their own allocator and never counted. Counting is two atomic
// adds per allocation.
#pragma once

#include <cstdint>

namespace dtrain::framework {

class TrackedCpuMemory {
 public:
  // Makes the counting allocator the CPU allocator of this process (idempotent).
  static void install();
  static bool installed();
  static int64_t current_bytes();
  static int64_t peak_bytes();
  // Peak := current, to measure the peak of a phase.
  static void reset_peak();
};

}  // namespace dtrain::framework
