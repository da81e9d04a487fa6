#include "framework/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstring>

namespace dtrain::framework {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};

// Allocates through c10's aligned CPU allocation with a 64-byte header holding the size, so
// the context is the data pointer itself (as c10's default allocator's is: raw_allocate and
// raw_deallocate work) and the deleter knows what to subtract.
constexpr size_t kHeader = 64;  // keeps c10's 64-byte alignment

void release(void* data) {
  char* base = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, base, sizeof(bytes));
  g_current.fetch_sub(bytes);
  c10::free_cpu(base);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    const int64_t bytes = static_cast<int64_t>(n);
    std::memcpy(base, &bytes, sizeof(bytes));
    const int64_t now = g_current.fetch_add(bytes) + bytes;
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
    }
    void* data = base + kHeader;
    return {data, data, &release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

}  // namespace

void TrackedCpuMemory::install() {
  if (g_installed.exchange(true)) return;
  static CountingAllocator allocator;
  c10::SetCPUAllocator(&allocator, /*priority=*/10);
}

bool TrackedCpuMemory::installed() { return g_installed.load(); }
int64_t TrackedCpuMemory::current_bytes() { return g_current.load(); }
int64_t TrackedCpuMemory::peak_bytes() { return g_peak.load(); }
void TrackedCpuMemory::reset_peak() { g_peak.store(g_current.load()); }

}  // namespace dtrain::framework
