// The caching logic, tested without a GPU through a counting fake backend.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <vector>

#include "moecore/core/allocator.h"
#include "moecore/core/allocator_pools.h"
#include "moecore/core/error.h"

#include <map>

using namespace moecore;

namespace {
struct FakeDevice {
  int64_t capacity;
  int64_t used = 0;
  int mallocs = 0, frees = 0;
  std::map<void*, size_t> live;
  CachingAllocator::Backend backend(bool cache = true) {
    return {"fake:0",
            [this](size_t n) -> void* {
              if (used + static_cast<int64_t>(n) > capacity) return nullptr;
              void* p = std::malloc(n);
              used += static_cast<int64_t>(n);
              live[p] = n;
              ++mallocs;
              return p;
            },
            [this](void* p) {
              used -= static_cast<int64_t>(live.at(p));
              live.erase(p);
              std::free(p);
              ++frees;
            },
            cache};
  }
};
constexpr size_t MiB = 1u << 20;
}  // namespace

TEST(CachingAllocator, RoundsSizes) {
  EXPECT_EQ(CachingAllocator::round_size(0), 512u);
  EXPECT_EQ(CachingAllocator::round_size(1), 512u);
  EXPECT_EQ(CachingAllocator::round_size(513), 1024u);
  EXPECT_EQ(CachingAllocator::round_size(MiB), MiB);
  EXPECT_EQ(CachingAllocator::round_size(MiB + 1), 2 * MiB);
  EXPECT_EQ(CachingAllocator::round_size(5 * MiB), 6 * MiB);
}

TEST(CachingAllocator, ReusesFreedBlocksOnTheSameStream) {
  FakeDevice dev{1 << 30};
  CachingAllocator a(dev.backend());
  void* p = a.allocate(3 * MiB);
  a.deallocate(p);
  void* q = a.allocate(3 * MiB);
  EXPECT_EQ(p, q);
  EXPECT_EQ(dev.mallocs, 1);
  const AllocatorStats s = a.stats();
  EXPECT_EQ(s.num_cache_hits, 1);
  EXPECT_EQ(s.num_allocs, 2);
  EXPECT_EQ(s.allocated_bytes, static_cast<int64_t>(4 * MiB));
  EXPECT_EQ(s.reserved_bytes, static_cast<int64_t>(4 * MiB));
  // A block on another stream is not reused (its old stream may still be reading it).
  int other_stream;
  a.deallocate(q);
  void* r = a.allocate(3 * MiB, &other_stream);
  EXPECT_NE(r, q);
  EXPECT_EQ(dev.mallocs, 2);
  a.deallocate(r);
}

// A cached block larger than a request is split (best fit; the rest stays cached) and freed
// neighbours merge again, so the backend does not grow for smaller requests.
TEST(CachingAllocator, SplitsLargerBlocksAndMergesThemBack) {
  FakeDevice dev{1 << 30};
  CachingAllocator a(dev.backend());
  char* big = static_cast<char*>(a.allocate(64 * MiB));
  a.deallocate(big);
  void* small = a.allocate(2 * MiB);   // the first 2 MiB of the cached 64
  EXPECT_EQ(small, big);
  void* near = a.allocate(60 * MiB);   // the next 60 of the remaining 62
  EXPECT_EQ(near, big + 2 * MiB);
  EXPECT_EQ(dev.mallocs, 1);
  EXPECT_EQ(a.stats().allocated_bytes, static_cast<int64_t>(62 * MiB));
  EXPECT_EQ(a.stats().reserved_bytes, static_cast<int64_t>(64 * MiB));
  a.deallocate(small);
  a.deallocate(near);                  // merges with both cached neighbours: 64 MiB again
  EXPECT_EQ(a.allocate(64 * MiB), big);
  EXPECT_EQ(dev.mallocs, 1);
  a.deallocate(big);
  // Small requests come from 2 MiB segments of their own, never out of a large block.
  void* tiny = a.allocate(4096);
  EXPECT_NE(tiny, big);
  EXPECT_EQ(dev.mallocs, 2);
  void* tiny2 = a.allocate(4096);      // the same small segment
  EXPECT_EQ(static_cast<char*>(tiny2), static_cast<char*>(tiny) + 4096);
  EXPECT_EQ(dev.mallocs, 2);
  a.deallocate(tiny);
  a.deallocate(tiny2);
  a.empty_cache();
  EXPECT_EQ(dev.used, 0) << "every segment, merged whole again, went back to the backend";
}

// A segment with a block in use cannot go back to the backend: out of memory, only the wholly
// cached segments are released before the retry.
TEST(CachingAllocator, OutOfMemoryReleasesOnlyWhollyCachedSegments) {
  FakeDevice dev{static_cast<int64_t>(16 * MiB)};
  CachingAllocator a(dev.backend());
  void* first = a.allocate(8 * MiB);
  void* whole = a.allocate(4 * MiB);
  a.deallocate(whole);
  a.deallocate(first);
  void* part = a.allocate(2 * MiB);      // best fit: the 4 MiB segment's first half
  EXPECT_EQ(part, whole);
  void* in_first = a.allocate(6 * MiB);  // the 8 MiB segment's first 6
  EXPECT_EQ(in_first, first);
  try {  // 12 MiB reserved, both segments in use: nothing to release, the backend cannot give 8
    a.allocate(8 * MiB);
    FAIL() << "allocation beyond capacity succeeded";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "fake:0 out of memory: tried to allocate 8.0 MiB; 8.0 MiB allocated, 12.0 MiB reserved by moecore "
                 "(peak 12.0 MiB)");
  }
  a.deallocate(part);                    // the 4 MiB segment is wholly cached again
  void* q = a.allocate(8 * MiB);         // fails once, releases those 4 MiB, succeeds
  EXPECT_EQ(a.stats().num_ooms, 2);
  EXPECT_EQ(a.stats().reserved_bytes, static_cast<int64_t>(16 * MiB));
  a.deallocate(q);
  a.deallocate(in_first);
  a.empty_cache();
  EXPECT_EQ(dev.used, 0);
}

TEST(CachingAllocator, PeakAndReset) {
  FakeDevice dev{1 << 30};
  CachingAllocator a(dev.backend());
  void* p = a.allocate(10 * MiB);
  void* q = a.allocate(10 * MiB);
  a.deallocate(p);
  EXPECT_EQ(a.stats().peak_allocated_bytes, static_cast<int64_t>(20 * MiB));
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_allocated_bytes, static_cast<int64_t>(10 * MiB));
  a.deallocate(q);
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes, 0);
  EXPECT_EQ(dev.used, 0);
}

TEST(CachingAllocator, OutOfMemoryFlushesTheCacheThenRetries) {
  FakeDevice dev{static_cast<int64_t>(10 * MiB)};
  CachingAllocator a(dev.backend());
  void* p = a.allocate(6 * MiB);
  a.deallocate(p);                  // cached: 6 MiB still held by the backend
  void* q = a.allocate(8 * MiB);    // fails, flushes the cached 6 MiB, retries and succeeds
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(a.stats().num_ooms, 1);
  try {
    a.allocate(8 * MiB);
    FAIL() << "allocation beyond capacity succeeded";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "fake:0 out of memory: tried to allocate 8.0 MiB; 8.0 MiB allocated, 8.0 MiB reserved by moecore "
                 "(peak 8.0 MiB)");
  }
  a.deallocate(q);
}

TEST(CachingAllocator, WithoutCachingFreesImmediately) {
  FakeDevice dev{1 << 30};
  CachingAllocator a(dev.backend(/*cache=*/false));
  void* p = a.allocate(1000);
  a.deallocate(p);
  EXPECT_EQ(dev.frees, 1);
  EXPECT_EQ(a.stats().reserved_bytes, 0);
  EXPECT_THROW(a.deallocate(reinterpret_cast<void*>(0x1234)), Error);
}

// CUDA graphs' memory (train/train_graph.h): the blocks a capture uses -- its own allocations and
// whatever is freed during it -- are never handed to allocations outside the pool, even when freed
// after the capture, until the pool is released.
TEST(CachingAllocator, PrivatePoolKeepsItsBlocksUntilReleased) {
  FakeDevice dev{1 << 30};
  CachingAllocator a(dev.backend());
  void* before = a.allocate(3 * MiB);  // allocated before the capture, freed during it
  void* spare = a.allocate(5 * MiB);
  a.deallocate(spare);                 // a free general block: the capture may take it
  begin_private_pool(a, 1);
  void* temp = a.allocate(7 * MiB);    // a fresh block of the pool (larger than the cached one)
  a.deallocate(temp);
  void* again = a.allocate(7 * MiB);   // reused inside the pool (the graph's order is the replay's)
  EXPECT_EQ(again, temp);
  void* taken = a.allocate(5 * MiB);   // from the general cache into the pool
  EXPECT_EQ(taken, spare);
  void* kept = a.allocate(1 * MiB);    // outlives the capture (an output the host reads)
  a.deallocate(before);
  a.deallocate(again);
  a.deallocate(taken);
  end_private_pool(a);
  EXPECT_EQ(private_pool_bytes(a, 1), static_cast<int64_t>(8 * MiB + 6 * MiB + 1 * MiB + 4 * MiB));
  a.deallocate(kept);
  // Nothing of the pool serves requests outside it.
  std::set<void*> pool = {before, temp, taken, kept};
  std::vector<void*> outside;
  for (size_t mib : {1, 3, 5}) {
    outside.push_back(a.allocate(mib * MiB));
    EXPECT_EQ(pool.count(outside.back()), 0u) << mib << " MiB came from the private pool";
  }
  // Released: its blocks serve everyone again.
  release_private_pool(a, 1);
  EXPECT_EQ(private_pool_bytes(a, 1), 0);
  void* p = a.allocate(3 * MiB);
  EXPECT_EQ(pool.count(p), 1u);
  a.deallocate(p);
  for (void* q : outside) a.deallocate(q);
  a.empty_cache();
  EXPECT_EQ(dev.used, 0) << "every block went back to the backend";
}
