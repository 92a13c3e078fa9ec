// Random fills from Philox (core/philox.h): element i of t gets the number for
// (seed, key, index_offset + i), on any device. A shard of a parameter passes the global index
// of its first element as index_offset (for row-sharded layouts) and draws exactly the values
// the unsharded parameter has there.
#pragma once

#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore::ops {

void fill_uniform(Tensor& t, uint64_t seed, uint64_t key, double lo, double hi, int64_t index_offset = 0);
void fill_normal(Tensor& t, uint64_t seed, uint64_t key, double mean, double std, int64_t index_offset = 0);

namespace cpu {
void fill_random(bool normal, Tensor& t, uint64_t seed, uint64_t key, double a, double b, int64_t offset);
}
namespace cuda {
void fill_random(bool normal, Tensor& t, uint64_t seed, uint64_t key, double a, double b, int64_t offset);
}

}  // namespace moecore::ops
