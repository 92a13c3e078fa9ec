#include "moecore/core/allocator.h"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "moecore/core/allocator_pools.h"
#include "moecore/core/device.h"
#include "moecore/core/error.h"

#if MOECORE_WITH_CUDA
#include "moecore/core/cuda_check.h"
#endif

namespace moecore {

namespace {
constexpr size_t kSmallLimit = 1u << 20;
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = 2u << 20;
constexpr size_t kSmallSegment = 2u << 20;  // the backend allocation small blocks are cut from

std::string mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

// Private pools (allocator_pools.h), kept beside the allocators: one allocator's pools, guarded by
// g_pools_mutex (taken after the allocator's own mutex, never before it).
using FreeList = std::multimap<std::pair<void*, size_t>, void*>;  // (stream, size) -> ptr
struct PrivatePools {
  int capturing = 0;                        // the pool capturing now (0: none)
  std::map<int, FreeList> free;             // each pool's free blocks
  std::map<int, int64_t> bytes;             // each pool's blocks' bytes
  std::unordered_map<void*, int> owner;     // block -> its pool
  FreeList released;                        // released pools' free blocks, for the general cache
};
std::mutex g_pools_mutex;
std::atomic<int> g_pools_in_use{0};         // allocators with pools: the others skip the lookups
std::unordered_map<const CachingAllocator*, PrivatePools> g_pools;

PrivatePools* pools_of(const CachingAllocator* a) {
  if (g_pools_in_use.load(std::memory_order_acquire) == 0) return nullptr;
  auto it = g_pools.find(a);
  return it == g_pools.end() ? nullptr : &it->second;
}

// The first block of `list` that serves `size` on `stream` (the general cache's rule), or null.
void* take_block(FreeList& list, void* stream, size_t size, size_t* got) {
  auto it = list.lower_bound({stream, size});
  const size_t slack = size <= kSmallLimit ? 0 : size / 8;
  if (it == list.end() || it->first.first != stream || it->first.second > size + slack) return nullptr;
  void* ptr = it->second;
  *got = it->first.second;
  list.erase(it);
  return ptr;
}

// A released pool's free blocks, for the general cache.
FreeList take_released(const CachingAllocator* a) {
  FreeList out;
  if (g_pools_in_use.load(std::memory_order_acquire) == 0) return out;
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  PrivatePools* p = pools_of(a);
  if (p) out.swap(p->released);
  return out;
}
}  // namespace

CachingAllocator::CachingAllocator(Backend backend) : backend_(std::move(backend)) {}

CachingAllocator::~CachingAllocator() {
  // Process exit: return cached blocks; live blocks belong to tensors that outlive us (statics).
  std::lock_guard<std::mutex> lock(mutex_);
  drain_released_locked();
  release_cached_locked();
}

size_t CachingAllocator::round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes <= kSmallLimit) return (bytes + kSmallRound - 1) / kSmallRound * kSmallRound;
  return (bytes + kLargeRound - 1) / kLargeRound * kLargeRound;
}

void* CachingAllocator::allocate(size_t bytes, void* stream) {
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  drain_released_locked();
  stats_.num_allocs++;
  void* ptr = nullptr;
  size_t got = size;
  // A capture into a private pool: the pool's free blocks first, then the general cache's and new
  // ones, which join the pool.
  std::unique_lock<std::mutex> pools_lock(g_pools_mutex, std::defer_lock);
  PrivatePools* pools = nullptr;
  if (g_pools_in_use.load(std::memory_order_acquire) != 0) {
    pools_lock.lock();
    pools = pools_of(this);
    if (pools && pools->capturing == 0) pools = nullptr;
    if (!pools) pools_lock.unlock();
  }
  if (backend_.cache) {
    if (pools) ptr = take_block(pools->free[pools->capturing], stream, size, &got);
    if (ptr) {
      stats_.num_cache_hits++;
    } else {
      ptr = take_cached_locked(stream, size, &got);
      if (ptr) {
        stats_.num_cache_hits++;
        if (pools) pools->bytes[pools->capturing] += static_cast<int64_t>(got);
      }
    }
  }
  if (!ptr) {
    ptr = backend_.cache ? new_segment_locked(size, stream) : backend_.raw_alloc(size);
    if (!ptr) {
      stats_.num_ooms++;
      // Freeing cached blocks (cudaFree) is not allowed while a CUDA graph captures: it would
      // invalidate the capture and lose the blocks. The capture's allocation fails instead.
      MC_CHECK(!pools, backend_.name, " out of memory while capturing a CUDA graph: tried to allocate ",
               mib(static_cast<int64_t>(size)), "; ", mib(stats_.allocated_bytes), " allocated, ",
               mib(stats_.reserved_bytes), " reserved by moecore (run without --cuda-graph-impl, or with less memory)");
      release_cached_locked();
      ptr = backend_.cache ? new_segment_locked(size, stream) : backend_.raw_alloc(size);
    }
    MC_CHECK(ptr != nullptr, backend_.name, " out of memory: tried to allocate ", mib(static_cast<int64_t>(size)),
             "; ", mib(stats_.allocated_bytes), " allocated, ", mib(stats_.reserved_bytes),
             " reserved by moecore (peak ", mib(stats_.peak_allocated_bytes), ")");
    if (!backend_.cache) {  // new_segment_locked counts its own
      stats_.num_backend_allocs++;
      stats_.reserved_bytes += static_cast<int64_t>(size);
      stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    }
    if (pools) pools->bytes[pools->capturing] += static_cast<int64_t>(size);
  }
  if (pools) pools->owner[ptr] = pools->capturing;
  Block& block = live_[ptr] = Block{got, stream, bytes, memory_tag(MemoryCategory::kUntagged)};
  stats_.allocated_bytes += static_cast<int64_t>(got);
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  if (memory_accounting_enabled()) account_allocate_locked(block);
  return ptr;
}

void CachingAllocator::deallocate(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  MC_CHECK(it != live_.end(), backend_.name, " allocator: free of a pointer it did not allocate");
  const Block b = it->second;
  live_.erase(it);
  stats_.num_frees++;
  stats_.allocated_bytes -= static_cast<int64_t>(b.size);
  bool pooled = false;
  if (backend_.cache && g_pools_in_use.load(std::memory_order_acquire) != 0) {
    std::lock_guard<std::mutex> pools_lock(g_pools_mutex);
    if (PrivatePools* p = pools_of(this)) {
      auto owner = p->owner.find(ptr);
      int pool = owner == p->owner.end() ? 0 : owner->second;
      if (pool == 0 && p->capturing != 0) {  // freed during a capture: the graph's from now on
        pool = p->owner[ptr] = p->capturing;
        p->bytes[pool] += static_cast<int64_t>(b.size);
      }
      if (pool != 0) {
        p->free[pool].insert({{b.stream, b.size}, ptr});
        pooled = true;
      }
    }
  }
  if (pooled) {
  } else if (backend_.cache) {
    drain_released_locked();
    cache_piece_locked(ptr);
  } else {
    backend_.raw_free(ptr);
    stats_.reserved_bytes -= static_cast<int64_t>(b.size);
  }
  if (memory_accounting_enabled()) account_free_locked(b);
}

void CachingAllocator::account_allocate_locked(Block& b) {
  if (!ledger_.started()) {  // the blocks handed out before accounting began stay untagged
    int64_t requested = 0;
    for (const auto& [p, live] : live_)
      if (&live != &b) requested += static_cast<int64_t>(live.requested);
    ledger_.start(requested, stats_.allocated_bytes - static_cast<int64_t>(b.size), stats_.reserved_bytes);
  }
  b.tag = current_memory_tag();
  ledger_.on_allocate(b.tag, static_cast<int64_t>(b.requested), static_cast<int64_t>(b.size), stats_.allocated_bytes,
                      stats_.reserved_bytes);
}

void CachingAllocator::account_free_locked(const Block& b) {
  if (!ledger_.started()) {
    int64_t requested = static_cast<int64_t>(b.requested);  // b is already out of live_
    for (const auto& [p, live] : live_) requested += static_cast<int64_t>(live.requested);
    ledger_.start(requested, stats_.allocated_bytes + static_cast<int64_t>(b.size), stats_.reserved_bytes);
  }
  ledger_.on_free(b.tag, static_cast<int64_t>(b.requested), static_cast<int64_t>(b.size), stats_.reserved_bytes);
}

// ---- segments and their pieces (the general cache) ----------------------------------
CachingAllocator::FreePieces& CachingAllocator::free_list(bool small) { return small ? free_small_ : free_large_; }

void CachingAllocator::unlist_locked(uintptr_t addr, const Piece& piece) {
  FreePieces& list = free_list(piece.small);
  auto [lo, hi] = list.equal_range({piece.stream, piece.size});
  for (auto it = lo; it != hi; ++it)
    if (reinterpret_cast<uintptr_t>(it->second) == addr) {
      list.erase(it);
      return;
    }
  MC_FAIL(backend_.name, " allocator: a cached block is missing from its free list");
}

void* CachingAllocator::take_cached_locked(void* stream, size_t size, size_t* got) {
  const bool small = size <= kSmallLimit;
  FreePieces& list = free_list(small);
  auto it = list.lower_bound({stream, size});  // the smallest cached piece that fits (best fit)
  if (it == list.end() || it->first.first != stream) return nullptr;
  void* ptr = it->second;
  list.erase(it);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
  Piece& piece = pieces_.at(addr);
  piece.cached = false;
  if (piece.size > size) {  // the rest stays cached (sizes are multiples of the rounding)
    const Piece rest{piece.size - size, stream, piece.segment, small, true};
    pieces_.emplace(addr + size, rest);
    free_list(small).insert({{stream, rest.size}, reinterpret_cast<void*>(addr + size)});
    piece.size = size;
  }
  *got = size;
  return ptr;
}

void* CachingAllocator::new_segment_locked(size_t size, void* stream) {
  const bool small = size <= kSmallLimit;
  const size_t bytes = small ? kSmallSegment : size;
  void* base = backend_.raw_alloc(bytes);
  if (!base) return nullptr;
  stats_.num_backend_allocs++;
  stats_.reserved_bytes += static_cast<int64_t>(bytes);
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  const uint64_t id = next_segment_++;
  segments_[id] = bytes;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(base);
  pieces_.emplace(addr, Piece{size, stream, id, small, false});
  if (bytes > size) {
    pieces_.emplace(addr + size, Piece{bytes - size, stream, id, small, true});
    free_list(small).insert({{stream, bytes - size}, reinterpret_cast<void*>(addr + size)});
  }
  return base;
}

void CachingAllocator::cache_piece_locked(void* ptr) {
  auto it = pieces_.find(reinterpret_cast<uintptr_t>(ptr));
  MC_CHECK(it != pieces_.end(), backend_.name, " allocator: a freed block belongs to no segment");
  // Merge with the cached neighbours of the same segment (blocks of a segment are contiguous).
  auto next = std::next(it);
  if (next != pieces_.end() && next->second.cached && next->second.segment == it->second.segment &&
      it->first + it->second.size == next->first) {
    unlist_locked(next->first, next->second);
    it->second.size += next->second.size;
    pieces_.erase(next);
  }
  if (it != pieces_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.cached && prev->second.segment == it->second.segment &&
        prev->first + prev->second.size == it->first) {
      unlist_locked(prev->first, prev->second);
      prev->second.size += it->second.size;
      pieces_.erase(it);
      it = prev;
    }
  }
  it->second.cached = true;
  free_list(it->second.small).insert({{it->second.stream, it->second.size}, reinterpret_cast<void*>(it->first)});
}

void CachingAllocator::drain_released_locked() {
  for (const auto& [key, ptr] : take_released(this)) cache_piece_locked(ptr);
}

// Segments wholly cached go back to the backend; a segment with a block in use stays.
void CachingAllocator::release_cached_locked() {
  for (auto it = pieces_.begin(); it != pieces_.end();) {
    const Piece& piece = it->second;
    auto seg = segments_.find(piece.segment);
    if (!piece.cached || seg == segments_.end() || seg->second != piece.size) {
      ++it;
      continue;
    }
    unlist_locked(it->first, piece);
    backend_.raw_free(reinterpret_cast<void*>(it->first));
    stats_.reserved_bytes -= static_cast<int64_t>(piece.size);
    segments_.erase(seg);
    it = pieces_.erase(it);
  }
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  drain_released_locked();
  release_cached_locked();
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
  ledger_.reset_peak();
}

MemoryBreakdown CachingAllocator::breakdown_at_peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ledger_.at_peak();
}

MemoryBreakdown CachingAllocator::breakdown_now() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ledger_.current();
}

// ---- process-wide instances ------------------------------------------------------
// Allocators are leaked on purpose: tensors in static storage may be freed after main()
// returns, and the CUDA runtime may be torn down by then.
CachingAllocator& cpu_allocator() {
  static CachingAllocator* a = new CachingAllocator(CachingAllocator::Backend{
      "host memory",
      [](size_t n) -> void* { return std::aligned_alloc(64, (n + 63) / 64 * 64); },
      [](void* p) { std::free(p); },
      /*cache=*/false});
  return *a;
}

CachingAllocator& cuda_allocator(int device_index) {
#if MOECORE_WITH_CUDA
  static std::mutex m;
  static std::vector<CachingAllocator*> per_device;
  std::lock_guard<std::mutex> lock(m);
  const int count = cuda_device_count();
  MC_CHECK(count > 0, "CUDA memory requested but ", cuda_unavailable_reason());
  MC_CHECK(device_index >= 0 && device_index < count, "CUDA device ", device_index, " does not exist (", count,
           " present)");
  if (per_device.empty()) per_device.resize(static_cast<size_t>(count), nullptr);
  auto& slot = per_device[static_cast<size_t>(device_index)];
  if (!slot) {
    slot = new CachingAllocator(CachingAllocator::Backend{
        "cuda:" + std::to_string(device_index),
        [device_index](size_t n) -> void* {
          void* p = nullptr;
          MC_CUDA_CHECK(cudaSetDevice(device_index));
          // A block first needed while a stream is captured into a CUDA graph (train/decode_step.h):
          // cudaMalloc is not part of the graph, and the block stays with the capturing stream's
          // cache, so the graph's replays find it at the same address. The relaxed mode lets the
          // call through a capture that refuses other unsafe calls; the previous mode comes back.
          cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
          MC_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
          const cudaError_t err = cudaMalloc(&p, n);
          MC_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
          if (err != cudaSuccess) {
            cudaGetLastError();
            return nullptr;
          }
          return p;
        },
        [device_index](void* p) {
          cudaSetDevice(device_index);
          count_host_synchronization();  // cudaFree waits for the device
          cudaFree(p);
        },
        /*cache=*/true});
  }
  return *slot;
#else
  (void)device_index;
  MC_FAIL("CUDA memory requested but ", cuda_unavailable_reason());
#endif
}

namespace {
// Without a CUDA device "pinned" host memory is plain host memory of its own allocator, so that
// host-resident state (--optimizer-cpu-offload) stays apart from the CPU device's memory report.
CachingAllocator& unpinned_host_allocator() {
  static CachingAllocator* a = new CachingAllocator(CachingAllocator::Backend{
      "host memory (no CUDA device: not pinned)",
      [](size_t n) -> void* { return std::aligned_alloc(64, (n + 63) / 64 * 64); },
      [](void* p) { std::free(p); },
      /*cache=*/false});
  return *a;
}
}  // namespace

CachingAllocator& pinned_allocator() {
#if MOECORE_WITH_CUDA
  if (cuda_device_count() == 0) return unpinned_host_allocator();
  static CachingAllocator* a = [] {
    return new CachingAllocator(CachingAllocator::Backend{
        "pinned host memory",
        [](size_t n) -> void* {
          void* p = nullptr;
          if (cudaHostAlloc(&p, n, cudaHostAllocDefault) != cudaSuccess) {
            cudaGetLastError();
            return nullptr;
          }
          return p;
        },
        [](void* p) {
          count_host_synchronization();  // cudaFreeHost waits for the device
          cudaFreeHost(p);
        },
        /*cache=*/true});
  }();
  return *a;
#else
  return unpinned_host_allocator();
#endif
}

// ---- private pools (allocator_pools.h) ---------------------------------------------
void begin_private_pool(CachingAllocator& a, int id) {
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  MC_CHECK(id > 0, a.name(), " allocator: private pool ids are positive, got ", id);
  auto [it, inserted] = g_pools.try_emplace(&a);
  if (inserted) g_pools_in_use.fetch_add(1, std::memory_order_acq_rel);
  PrivatePools& p = it->second;
  MC_CHECK(p.capturing == 0, a.name(), " allocator: private pool ", id, " begun while pool ", p.capturing, " captures");
  p.capturing = id;
  p.free[id];  // the pool exists from now on
}

void end_private_pool(CachingAllocator& a) {
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  if (PrivatePools* p = pools_of(&a)) p->capturing = 0;
}

void release_private_pool(CachingAllocator& a, int id) {
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  PrivatePools* p = pools_of(&a);
  if (!p) return;
  MC_CHECK(p->capturing != id, a.name(), " allocator: private pool ", id, " released while it captures");
  auto it = p->free.find(id);
  if (it == p->free.end()) return;
  p->released.insert(it->second.begin(), it->second.end());  // the general cache's at the next call
  p->free.erase(it);
  p->bytes.erase(id);
  for (auto o = p->owner.begin(); o != p->owner.end();) o = o->second == id ? p->owner.erase(o) : std::next(o);
}

int64_t private_pool_bytes(const CachingAllocator& a, int id) {
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  PrivatePools* p = pools_of(&a);
  if (!p) return 0;
  auto it = p->bytes.find(id);
  return it == p->bytes.end() ? 0 : it->second;
}

CachingAllocator& allocator_for(Device device, bool pinned) {
  if (device.is_cuda()) return cuda_allocator(device.index);
  return pinned ? pinned_allocator() : cpu_allocator();
}

}  // namespace moecore
