// CUDA embedding.
//   forward:  one 256-thread block per token copies its table row, or writes zeros for an id
//             of another vocabulary part (ids checked in the kernel; the first bad position
//             goes to a device flag through integer atomicMin).
//   backward: deterministic, no float atomics, O(T * H) plus a sort:
//             1. a kernel checks ids (flag read on the host before dtable is touched) and
//                writes positions 0..T-1 and sort keys: the local row id - vocab_start, or
//                V (one past the part's rows) for ids of other parts;
//             2. cub's stable radix sort orders (key, position) pairs by key, so each row's
//                tokens stay in increasing t (and other parts' tokens gather at the end);
//             3. grid (T, column chunks): block i owns the run of equal keys starting at sorted
//                position i (other blocks exit, as does the run of key V) and adds the run's
//                dout rows to dtable's row, starting from dtable's value, in increasing t: the
//                CPU's order exactly.
#include <cub/device/device_radix_sort.cuh>

#include <cstdint>

#include "moecore/ops/common.h"
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/embedding.h"

namespace moecore::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kNoBadPosition = 0x7F7F7F7F;  // cudaMemsetAsync byte pattern 0x7F

template <typename T>
__global__ void embedding_forward_kernel(const T* table, const int32_t* ids, T* out, EmbeddingPart part,
                                         int64_t hidden, int* bad) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  const int64_t row = id - part.start;
  T* dst = out + t * hidden;
  if (id < 0 || id >= part.total || row < 0 || row >= part.rows) {  // invalid, or another part's
    if (threadIdx.x == 0 && (id < 0 || id >= part.total)) atomicMin(bad, static_cast<int>(t));
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = store<T>(0.0f);
    return;
  }
  const T* src = table + row * hidden;
  for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = src[c];
}

__global__ void check_ids_and_iota_kernel(const int32_t* ids, uint32_t* keys, int32_t* positions, int64_t tokens,
                                          EmbeddingPart part, int* bad) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tokens; t += int64_t(gridDim.x) * blockDim.x) {
    positions[t] = static_cast<int32_t>(t);
    const int32_t id = ids[t];
    if (id < 0 || id >= part.total) atomicMin(bad, static_cast<int>(t));
    const int64_t row = id - part.start;
    keys[t] = static_cast<uint32_t>(row >= 0 && row < part.rows ? row : part.rows);
  }
}

template <typename T>
__global__ void embedding_accumulate_kernel(const uint32_t* sorted_ids, const int32_t* sorted_positions,
                                            const T* dout, float* dtable, int64_t tokens, int64_t hidden,
                                            uint32_t other_parts) {
  const int64_t i = blockIdx.x;
  const uint32_t id = sorted_ids[i];
  if (id == other_parts) return;                 // tokens of other vocabulary parts
  if (i > 0 && sorted_ids[i - 1] == id) return;  // not the start of a run
  float* row = dtable + static_cast<int64_t>(id) * hidden;
  for (int64_t c = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; c < hidden; c += int64_t(gridDim.y) * blockDim.x) {
    float acc = row[c];
    for (int64_t j = i; j < tokens && sorted_ids[j] == id; ++j)
      acc += load(dout[static_cast<int64_t>(sorted_positions[j]) * hidden + c]);
    row[c] = acc;
  }
}

Tensor make_flag(const Tensor& like, cudaStream_t s) {
  Tensor flag = Tensor::empty({1}, DType::I32, like.device());
  MC_CUDA_CHECK(cudaMemsetAsync(flag.data_ptr(), 0x7F, sizeof(int), s));
  return flag;
}

// A copy to pageable host memory on the current stream: waits for the kernels before it.
int64_t read_flag(const Tensor& flag) {
  const int32_t v = flag.to_vector<int32_t>()[0];
  return v == kNoBadPosition ? -1 : v;
}

}  // namespace

int64_t embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out, EmbeddingPart part, int64_t tokens,
                          int64_t hidden) {
  if (tokens == 0) return -1;
  MC_CHECK(tokens < kNoBadPosition, "embedding_forward: too many tokens (", tokens, ") for one launch");
  cudaStream_t s = prepare(table);
  Tensor flag = make_flag(table, s);
  dispatch_cuda_floating(table.dtype(), "embedding_forward", [&](auto tag) {
    using T = decltype(tag);
    embedding_forward_kernel<T><<<static_cast<unsigned>(tokens), kThreads, 0, s>>>(
        table.data<T>(), ids.data<int32_t>(), out.data<T>(), part, hidden, flag.data<int32_t>());
  });
  MC_CUDA_CHECK_LAUNCH();
  // Inside ops::EmbeddingIdsValidated the caller checked these ids on the host: no wait here.
  return EmbeddingIdsValidated::active() ? -1 : read_flag(flag);
}

int64_t embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, EmbeddingPart part, int64_t tokens,
                           int64_t hidden) {
  if (tokens == 0) return -1;
  MC_CHECK(tokens < kNoBadPosition, "embedding_backward: too many tokens (", tokens, ") for one launch");
  const Device dev = ids.device();
  cudaStream_t s = prepare(ids);

  // 1. Validate ids before dtable is modified; write the keys and positions to sort.
  Tensor flag = make_flag(ids, s);
  Tensor keys = Tensor::empty({tokens}, DType::I32, dev);
  Tensor positions = Tensor::empty({tokens}, DType::I32, dev);
  auto* keys_in = reinterpret_cast<uint32_t*>(keys.data<int32_t>());
  check_ids_and_iota_kernel<<<grid_for(tokens), kThreads, 0, s>>>(ids.data<int32_t>(), keys_in,
                                                                    positions.data<int32_t>(), tokens, part,
                                                                    flag.data<int32_t>());
  MC_CUDA_CHECK_LAUNCH();
  // Inside ops::EmbeddingIdsValidated the forward checked these ids already: no wait here.
  const int64_t bad = EmbeddingIdsValidated::active() ? -1 : read_flag(flag);
  if (bad >= 0 || hidden == 0) return bad;

  // 2. Stable sort by key. Keys are in [0, V] (V = the part's rows): sort them over just the
  //    bits V needs.
  int end_bit = 1;
  while (end_bit < 32 && (int64_t(1) << end_bit) <= part.rows) ++end_bit;
  const int n = static_cast<int>(tokens);
  Tensor sorted_keys = Tensor::empty({tokens}, DType::I32, dev);
  Tensor sorted_positions = Tensor::empty({tokens}, DType::I32, dev);
  auto* keys_out = reinterpret_cast<uint32_t*>(sorted_keys.data<int32_t>());
  size_t temp_bytes = 0;
  MC_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, positions.data<int32_t>(),
                                                sorted_positions.data<int32_t>(), n, 0, end_bit, s));
  Tensor temp = Tensor::empty({static_cast<int64_t>(temp_bytes < 1 ? 1 : temp_bytes)}, DType::U8, dev);
  MC_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, keys_in, keys_out,
                                                positions.data<int32_t>(), sorted_positions.data<int32_t>(), n, 0,
                                                end_bit, s));

  // 3. One block per run start and column chunk.
  const int64_t chunks = (hidden + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(chunks < 65535 ? chunks : 65535));
  dispatch_cuda_floating(dout.dtype(), "embedding_backward", [&](auto tag) {
    using T = decltype(tag);
    embedding_accumulate_kernel<T><<<grid, kThreads, 0, s>>>(keys_out, sorted_positions.data<int32_t>(),
                                                             dout.data<T>(), dtable.data<float>(), tokens, hidden,
                                                             static_cast<uint32_t>(part.rows));
  });
  MC_CUDA_CHECK_LAUNCH();
  return -1;
}

}  // namespace moecore::ops::cuda
