// Live bytes per memory tag (core/memory_categories.h) of one allocator, and their values at the
// moment the allocator's handed-out total reached its peak. CachingAllocator keeps one while
// memory accounting is on and feeds it every allocation and free under its lock.
#pragma once

#include <array>
#include <cstdint>

#include "moecore/core/memory_categories.h"

namespace moecore {

struct MemoryBreakdown {
  std::array<int64_t, kNumMemoryTags> by_tag{};  // requested bytes of the live blocks, per tag
  int64_t rounding = 0;   // handed-out bytes beyond the requests (size rounding, larger cached blocks)
  int64_t allocated = 0;  // handed out: the sum of by_tag plus rounding
  int64_t reserved = 0;   // obtained from the backend (handed out plus cached free blocks)
  int64_t tagged_sum() const;
};

class MemoryLedger {
 public:
  bool started() const { return started_; }
  // Starts with the blocks already live (untagged); allocated / reserved: the allocator's now.
  void start(int64_t live_requested, int64_t allocated, int64_t reserved);
  // got: the block's size as handed out (>= requested); allocated / reserved after the call.
  void on_allocate(MemoryTag tag, int64_t requested, int64_t got, int64_t allocated, int64_t reserved);
  void on_free(MemoryTag tag, int64_t requested, int64_t got, int64_t reserved);
  // The peak restarts at the current state (CachingAllocator::reset_peak).
  void reset_peak();
  const MemoryBreakdown& current() const { return current_; }
  const MemoryBreakdown& at_peak() const { return peak_; }

 private:
  bool started_ = false;
  MemoryBreakdown current_, peak_;
};

}  // namespace moecore
