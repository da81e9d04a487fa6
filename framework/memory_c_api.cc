// A C entry point to TrackedCpuMemory, so PyTorch reference scripts measure tensor memory
// with the same counting allocator as dtrain (bench/reference/*.py load it with ctypes right
// after importing torch, before building their model).
#include "framework/memory.h"

extern "C" {
void dtrain_tracked_install() { dtrain::framework::TrackedCpuMemory::install(); }
long long dtrain_tracked_current_bytes() {
  return dtrain::framework::TrackedCpuMemory::current_bytes();
}
long long dtrain_tracked_peak_bytes() { return dtrain::framework::TrackedCpuMemory::peak_bytes(); }
void dtrain_tracked_reset_peak() { dtrain::framework::TrackedCpuMemory::reset_peak(); }
}
