#include "moecore/core/memory_ledger.h"

namespace moecore {

int64_t MemoryBreakdown::tagged_sum() const {
  int64_t s = 0;
  for (int64_t b : by_tag) s += b;
  return s;
}

void MemoryLedger::start(int64_t live_requested, int64_t allocated, int64_t reserved) {
  current_ = MemoryBreakdown{};
  current_.by_tag[memory_tag(MemoryCategory::kUntagged)] = live_requested;
  current_.rounding = allocated - live_requested;
  current_.allocated = allocated;
  current_.reserved = reserved;
  peak_ = current_;
  started_ = true;
}

void MemoryLedger::on_allocate(MemoryTag tag, int64_t requested, int64_t got, int64_t allocated, int64_t reserved) {
  current_.by_tag[tag] += requested;
  current_.rounding += got - requested;
  current_.allocated = allocated;
  current_.reserved = reserved;
  if (allocated > peak_.allocated) peak_ = current_;
}

void MemoryLedger::on_free(MemoryTag tag, int64_t requested, int64_t got, int64_t reserved) {
  current_.by_tag[tag] -= requested;
  current_.rounding -= got - requested;
  current_.allocated -= got;
  current_.reserved = reserved;
}

void MemoryLedger::reset_peak() { peak_ = current_; }

}  // namespace moecore
