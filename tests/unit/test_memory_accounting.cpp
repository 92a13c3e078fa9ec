// Memory accounting (core/memory_categories.h, core/memory_ledger.h): blocks charged to the
// innermost scope, frees, the breakdown at the peak, reset_peak, and the rounding / cache
// overhead, through the caching allocator with a fake backend.
#include <gtest/gtest.h>

#include <cstdlib>

#include "moecore/core/allocator.h"
#include "moecore/core/memory_categories.h"

using namespace moecore;

namespace {
CachingAllocator::Backend malloc_backend(bool cache) {
  return {"fake:0", [](size_t n) -> void* { return std::malloc(n); }, [](void* p) { std::free(p); }, cache};
}
int64_t tag_bytes(const MemoryBreakdown& b, MemoryCategory c) { return b.by_tag[memory_tag(c)]; }
int64_t tag_bytes(const MemoryBreakdown& b, ActivationModule m) { return b.by_tag[memory_tag(m)]; }
}  // namespace

TEST(MemoryAccounting, TagsNamesAndCategories) {
  EXPECT_STREQ(memory_tag_name(memory_tag(ActivationModule::kCoreAttn)), "core_attn");
  EXPECT_STREQ(memory_tag_name(memory_tag(ActivationModule::kMoeAct)), "moe_act");
  EXPECT_STREQ(memory_tag_name(memory_tag(ActivationModule::kOther)), "other");
  EXPECT_STREQ(memory_tag_name(memory_tag(MemoryCategory::kOptimizerState)), "optimizer_state");
  EXPECT_EQ(memory_tag_category(memory_tag(ActivationModule::kExpertFc1)), MemoryCategory::kActivations);
  EXPECT_EQ(memory_tag_category(memory_tag(MemoryCategory::kGradients)), MemoryCategory::kGradients);
  for (int m = 0; m < kNumActivationModules; ++m)
    EXPECT_LT(memory_tag(static_cast<ActivationModule>(m)), kNumMemoryTags);
}

TEST(MemoryAccounting, ScopesFreesAndThePeakSnapshot) {
  enable_memory_accounting();  // process-wide; the other tests do not depend on it being off
  CachingAllocator a(malloc_backend(/*cache=*/false));
  void* untagged = a.allocate(1000);  // 1024 handed out: 24 B of rounding
  void* w = nullptr;
  void* fc1 = nullptr;
  void* act = nullptr;
  {
    MemoryCategoryScope weights(MemoryCategory::kWeights);
    w = a.allocate(4096);
    {
      MemoryCategoryScope fwd(MemoryCategory::kActivations);
      MemoryCategoryScope m(ActivationModule::kExpertFc1);
      fc1 = a.allocate(8192);
      MemoryCategoryScope inner(ActivationModule::kMoeAct);  // innermost wins
      act = a.allocate(2048);
    }
  }
  EXPECT_EQ(current_memory_tag(), memory_tag(MemoryCategory::kUntagged));  // every scope closed
  MemoryBreakdown now = a.breakdown_now();
  EXPECT_EQ(tag_bytes(now, MemoryCategory::kUntagged), 1000);
  EXPECT_EQ(tag_bytes(now, MemoryCategory::kWeights), 4096);
  EXPECT_EQ(tag_bytes(now, ActivationModule::kExpertFc1), 8192);
  EXPECT_EQ(tag_bytes(now, ActivationModule::kMoeAct), 2048);
  EXPECT_EQ(now.rounding, 24);
  EXPECT_EQ(now.tagged_sum() + now.rounding, a.stats().allocated_bytes);

  a.deallocate(fc1);  // the peak was before this free: the snapshot keeps expert_fc1
  now = a.breakdown_now();
  EXPECT_EQ(tag_bytes(now, ActivationModule::kExpertFc1), 0);
  const MemoryBreakdown peak = a.breakdown_at_peak();
  EXPECT_EQ(tag_bytes(peak, ActivationModule::kExpertFc1), 8192);
  EXPECT_EQ(peak.allocated, a.stats().peak_allocated_bytes);
  EXPECT_EQ(peak.tagged_sum() + peak.rounding, peak.allocated);
  EXPECT_EQ(peak.reserved, peak.allocated);  // no cache: nothing held beyond the live blocks

  // A smaller allocation does not move the peak; reset_peak restarts it at the current state.
  void* ws = nullptr;
  {
    MemoryCategoryScope s(MemoryCategory::kWorkspace);
    ws = a.allocate(512);
  }
  EXPECT_EQ(tag_bytes(a.breakdown_at_peak(), MemoryCategory::kWorkspace), 0);
  a.reset_peak();
  EXPECT_EQ(tag_bytes(a.breakdown_at_peak(), MemoryCategory::kWorkspace), 512);
  EXPECT_EQ(a.breakdown_at_peak().allocated, a.stats().peak_allocated_bytes);
  for (void* p : {untagged, w, act, ws}) a.deallocate(p);
  now = a.breakdown_now();
  EXPECT_EQ(now.tagged_sum(), 0);
  EXPECT_EQ(now.rounding, 0);
  EXPECT_EQ(now.allocated, 0);
}

TEST(MemoryAccounting, CachedBlocksAreOverheadAndReuseKeepsItsOwnTag) {
  enable_memory_accounting();
  CachingAllocator a(malloc_backend(/*cache=*/true));
  constexpr size_t MiB = 1u << 20;
  void* g = nullptr;
  {
    MemoryCategoryScope s(MemoryCategory::kGradients);
    g = a.allocate(4 * MiB);
  }
  a.deallocate(g);  // cached: reserved, not handed out
  void* o = nullptr;
  {
    MemoryCategoryScope s(MemoryCategory::kOptimizerState);
    o = a.allocate(4 * MiB - 100);  // served from the cache, charged to the new owner
  }
  const MemoryBreakdown now = a.breakdown_now();
  EXPECT_EQ(tag_bytes(now, MemoryCategory::kGradients), 0);
  EXPECT_EQ(tag_bytes(now, MemoryCategory::kOptimizerState), static_cast<int64_t>(4 * MiB - 100));
  EXPECT_EQ(now.rounding, 100);
  void* c = nullptr;
  {
    MemoryCategoryScope s(MemoryCategory::kCommunication);
    c = a.allocate(2 * MiB);
  }
  a.deallocate(c);
  const MemoryBreakdown peak = a.breakdown_at_peak();
  EXPECT_EQ(tag_bytes(peak, MemoryCategory::kCommunication), static_cast<int64_t>(2 * MiB));
  EXPECT_EQ(peak.reserved, a.stats().peak_reserved_bytes);
  const MemoryBreakdown after = a.breakdown_now();
  EXPECT_EQ(after.reserved - after.allocated, static_cast<int64_t>(2 * MiB));  // the cached block
  a.deallocate(o);
}
