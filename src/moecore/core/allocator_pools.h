// Private pools of a caching allocator (core/allocator.h), for CUDA graphs (train/train_graph.h),
// as PyTorch's graph memory pools. While pool `id` captures (begin_private_pool ..
// end_private_pool), every block the allocator hands out joins it (taken from the pool's own free
// blocks, else from the general cache, else from the backend) and so does every block freed,
// whoever allocated it. A pool's block, freed at any time, goes back to the pool's free list, which
// only a later capture into the same pool draws on: the memory a captured graph reads and writes
// is never handed to other work while the graph exists, so replaying it overwrites nothing else.
// release_private_pool (the graph destroyed) gives the pool's free blocks back to the general
// cache; its live blocks go there when freed. One pool captures at a time per allocator.
#pragma once

#include <cstdint>

#include "moecore/core/allocator.h"

namespace moecore {

void begin_private_pool(CachingAllocator& allocator, int id);  // id > 0
void end_private_pool(CachingAllocator& allocator);
void release_private_pool(CachingAllocator& allocator, int id);
// Bytes in the blocks of pool `id` (handed out or free in the pool); 0 once released.
int64_t private_pool_bytes(const CachingAllocator& allocator, int id);

}  // namespace moecore
