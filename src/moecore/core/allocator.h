// Caching allocators with statistics.
//
// cudaMalloc/cudaFree synchronise the device and cost tens of microseconds, so device memory
// is cached: a freed block goes to a free list keyed by (stream, size) and is handed out again
// to a request on the same stream. Reuse is safe without events because work on one stream runs
// in order; a block used on another stream must not be freed while that stream may still read it.
//
// Sizes are rounded: up to 1 MiB to a multiple of 512 B; above, to a multiple of 2 MiB. Each
// backend allocation is a segment: a large request's own size, or 2 MiB that small requests are
// cut from (small and large blocks never share a segment). A request takes the smallest cached
// block of its class on its stream that fits and leaves the rest cached; a freed block merges
// with the cached blocks beside it in its segment. So a freed large block serves smaller requests
// instead of the backend growing (the step's peak of reserved memory stays near its peak of
// handed-out memory). When the backend fails (out of memory), the wholly cached segments go back
// and the request is retried once; if it fails again, the Error reports the request and the
// statistics.
//
// The same class serves pinned host memory (cudaHostAlloc) and, with caching off, plain host
// memory (64-byte aligned), so every kind of memory has the same statistics.
//
// Memory accounting (core/memory_categories.h, on with --memory-report): each block is charged to
// the allocating thread's innermost MemoryCategoryScope, and a MemoryLedger keeps the live bytes
// per category and their values when the handed-out total peaked. Off, it costs one branch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "moecore/core/device.h"
#include "moecore/core/memory_ledger.h"

namespace moecore {

struct AllocatorStats {
  int64_t allocated_bytes = 0;        // bytes in blocks handed out and not freed (rounded sizes)
  int64_t reserved_bytes = 0;         // bytes obtained from the backend (handed out + cached)
  int64_t peak_allocated_bytes = 0;   // maximum of allocated_bytes since creation / reset_peak()
  int64_t peak_reserved_bytes = 0;
  int64_t num_allocs = 0;             // allocate() calls
  int64_t num_frees = 0;              // deallocate() calls
  int64_t num_backend_allocs = 0;     // calls into the backend (cudaMalloc, ...)
  int64_t num_cache_hits = 0;         // allocate() calls served from the cache
  int64_t num_ooms = 0;               // backend failures (each followed by a cache flush + retry)
};

class CachingAllocator {
 public:
  struct Backend {
    std::string name;                              // for messages: "cuda:0", "pinned", "cpu"
    std::function<void*(size_t)> raw_alloc;        // returns nullptr when out of memory
    std::function<void(void*)> raw_free;
    bool cache = true;                             // false: every free goes back to the backend
  };

  explicit CachingAllocator(Backend backend);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Returns a block of at least `bytes` (never nullptr; zero bytes gives a valid block).
  void* allocate(size_t bytes, void* stream = nullptr);
  void deallocate(void* ptr);
  // Returns every cached (free) block to the backend.
  void empty_cache();
  AllocatorStats stats() const;
  void reset_peak();
  // The accounting's live bytes per category and their values at the peak of the handed-out
  // total (since creation / reset_peak()); all zero while memory accounting is off.
  MemoryBreakdown breakdown_at_peak() const;
  MemoryBreakdown breakdown_now() const;
  static size_t round_size(size_t bytes);
  const std::string& name() const { return backend_.name; }

 private:
  struct Block {
    size_t size;       // as handed out (rounded; a cached block may be larger)
    void* stream;
    size_t requested;  // as asked for
    MemoryTag tag;     // memory accounting: the category charged
  };
  // Every block of the caching backends' segments, handed out or cached, by address.
  struct Piece {
    size_t size;
    void* stream;
    uint64_t segment;  // blocks merge only within their segment
    bool small;        // of a small-block segment
    bool cached;       // in the general cache's free list (not handed out, not in a private pool)
  };
  using FreePieces = std::multimap<std::pair<void*, size_t>, void*>;  // (stream, size) -> ptr
  FreePieces& free_list(bool small);
  void unlist_locked(uintptr_t addr, const Piece& piece);
  void* take_cached_locked(void* stream, size_t size, size_t* got);
  void* new_segment_locked(size_t size, void* stream);  // nullptr when the backend fails
  void cache_piece_locked(void* ptr);
  void drain_released_locked();  // released private pools' blocks join the general cache
  void release_cached_locked();
  void account_allocate_locked(Block& b);
  void account_free_locked(const Block& b);

  Backend backend_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, Block> live_;  // handed out
  std::map<uintptr_t, Piece> pieces_;
  std::unordered_map<uint64_t, size_t> segments_;  // id -> the backend allocation's bytes
  uint64_t next_segment_ = 1;
  FreePieces free_small_, free_large_;
  AllocatorStats stats_;
  MemoryLedger ledger_;
};

// Process-wide allocators. The CUDA ones exist only when the backend is built and a device is
// present; asking for one otherwise raises an Error that says why.
CachingAllocator& cpu_allocator();
CachingAllocator& cuda_allocator(int device_index);
// Pinned host memory; without a CUDA device (CPU builds, machines without one) plain host memory
// from an allocator of its own (Tensor::empty_pinned then still works, unpinned).
CachingAllocator& pinned_allocator();
CachingAllocator& allocator_for(Device device, bool pinned = false);

}  // namespace moecore
