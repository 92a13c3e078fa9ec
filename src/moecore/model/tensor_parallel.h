// Tensor, sequence and context parallelism of the dense (attention) part of the model:
// Megatron-Core's tensor_parallel mappings and its load-balanced context-parallel split.
//
// Token layouts. Activations are [T, H], T = B * s tokens, batch-major (each sequence's tokens
// contiguous).
//   Context parallelism (CP ranks, --context-parallel-size): every sequence of S tokens is cut
//   into 2 CP chunks of c = S / (2 CP); rank r keeps chunks r and 2 CP - 1 - r, in that order
//   (causal attention then costs the same on every rank), so its tokens are [B, 2c].
//   Sequence parallelism (--sequence-parallel, TP ranks): outside attention and the MLP's
//   column/row-parallel pair each TP rank keeps the slice [t s/TP, (t+1) s/TP) of every
//   sequence's (CP-local) tokens, i.e. [B, s/TP]; norms, residuals and the MoE layer run on it.
// Regions around a column-parallel ... row-parallel pair (Megatron's f and g):
//   enter_*  before the column-parallel layer: forward identity (no SP) or all-gather along the
//            sequence (SP); backward all-reduce (no SP) or reduce-scatter along the sequence.
//   exit_*   after the row-parallel layer (its output is a partial sum over TP): forward
//            all-reduce (no SP) or reduce-scatter along the sequence; backward identity or
//            all-gather.
// With B > 1 a sequence gather is an all-gather into [TP, B, s/TP, ...] reordered to
// [B, s, ...] (and the reverse before a reduce-scatter): one extra copy; none for B = 1.
//
// --tp-comm-overlap (tp_comm_overlap, with SP): the gather before a column-parallel linear and
// the reduce-scatter after a row-parallel one go in row chunks (RowChunks), each chunk's
// collective on a communication stream while the compute stream runs the GEMMs of the chunk
// before (reduce-scatter) or after (gather) it, ordered by CUDA events (tensor_parallel_overlap.cpp;
// model/layers.h: the linears around them).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/core/tensor.h"

namespace moecore {

// Rows [B*s, ...] of the ranks of `group`, each holding [B, s] of every sequence -> [B*n*s, ...]
// in sequence order (rank r's slice at [r s, (r+1) s) of each sequence).
Tensor gather_sequence(comm::Communicator& group, const Tensor& x, int64_t batch);
// The reverse, summed: x [B*n*s, ...] (every rank a partial sum) -> this rank's [B*s, ...].
Tensor reduce_scatter_sequence(comm::Communicator& group, const Tensor& x, int64_t batch);

struct DenseParallel {
  comm::Communicator* tp = nullptr;  // tensor-parallel group (null: TP = 1)
  comm::Communicator* cp = nullptr;  // context-parallel group (null: CP = 1)
  bool sequence_parallel = false;    // with TP > 1
  bool tp_comm_overlap = false;      // --tp-comm-overlap (with SP): the chunked collectives below
  int64_t tp_size() const { return tp ? tp->size() : 1; }
  int64_t tp_rank() const { return tp ? tp->rank() : 0; }
  int64_t cp_size() const { return cp ? cp->size() : 1; }
  int64_t cp_rank() const { return cp ? cp->rank() : 0; }
  bool sp() const { return sequence_parallel && tp != nullptr; }
  bool overlap() const { return tp_comm_overlap && sp(); }
  // Tokens of this rank between the blocks, given the CP-local tokens of the micro-batch.
  int64_t local_tokens(int64_t cp_tokens) const { return sp() ? cp_tokens / tp_size() : cp_tokens; }

  // The position in its sequence of each of this rank's tokens between the blocks (after the
  // CP and SP splits), [batch * local_tokens(cp_seq)], batch-major; cp_seq: the CP-local
  // sequence length (the whole sequence is cp_seq * CP long).
  std::vector<int32_t> token_positions(int64_t batch, int64_t cp_seq) const;

  Tensor enter_forward(const Tensor& x, int64_t batch) const;
  Tensor enter_backward(const Tensor& dx, int64_t batch) const;
  Tensor exit_forward(const Tensor& y, int64_t batch) const;
  Tensor exit_backward(const Tensor& dy, int64_t batch) const;
};

// ---- --tp-comm-overlap: the sequence gather and reduce-scatter in row chunks ---------------
// Chunk c is the row range [begin(c), end(c)) of this rank's R = B*s tokens, the same ranges on
// every rank; `count` = min(TP, R) chunks of R / count rows, the first R % count one row longer.
// Gathered over the n ranks, chunk c is [n * len(c), ...] rank-major (rank r's rows, then rank
// r+1's); in the sequence-order tensor [B*n*s, ...] those rows lie at rank r's slice of each
// sequence. GEMMs act on rows independently, so a chunk's rows give the rows the whole tensor
// would give.
struct RowChunks {
  int64_t ranks = 1, batch = 1, seq = 1;  // n, B, s (this rank's tokens of each sequence)
  int64_t count = 1;
  RowChunks(int64_t ranks, int64_t batch, int64_t local_rows);
  int64_t begin(int64_t c) const;
  int64_t end(int64_t c) const { return begin(c + 1); }
  int64_t len(int64_t c) const { return end(c) - begin(c); }
  // The pieces of chunk c contiguous in both layouts (one per rank and sequence it spans): rows
  // [at, at + rows) of the rank-major chunk are rows [full, full + rows) of the sequence order.
  struct Run {
    int64_t at, full, rows;
  };
  std::vector<Run> runs(int64_t c) const;
  // Chunk c's rows [n * len(c), ...] (rank-major) into their places in `full` [B*n*s, ...],
  // and the reverse (a new tensor).
  void put(Tensor& full, int64_t c, const Tensor& rows) const;
  Tensor take(const Tensor& full, int64_t c) const;
};

// gather_sequence in chunks: chunk c's all-gather runs on the communication stream (a GPU) while
// consume(c, rows) -- rows = the gathered chunk [n * len(c), ...], rank-major -- runs on the
// current stream for chunk c-1's rows. Returns the whole gathered tensor (sequence order).
Tensor gather_sequence_chunked(comm::Communicator& group, const Tensor& x, int64_t batch,
                               const std::function<void(int64_t, const Tensor&)>& consume);
// reduce_scatter_sequence in chunks: produce(c) returns chunk c's partial sums [n * len(c), ...]
// (rank-major, `width` features, dtype `dtype`); chunk c's reduce-scatter runs on the
// communication stream while chunk c+1 is produced; meanwhile() (when set) runs on the current
// stream after the last chunk is produced, beside its reduce-scatter. Returns this rank's
// [B*s, width], summed.
Tensor reduce_scatter_sequence_chunked(comm::Communicator& group, int64_t local_rows, int64_t width, int64_t batch,
                                       DType dtype, Device device, const std::function<Tensor(int64_t)>& produce,
                                       const std::function<void()>& meanwhile);

// Context parallelism: the global position of this rank's chunk i (0 or 1) of c tokens.
inline int64_t cp_chunk_start(int64_t chunk_len, int64_t cp_size, int64_t cp_rank, int chunk) {
  return (chunk == 0 ? cp_rank : 2 * cp_size - 1 - cp_rank) * chunk_len;
}
// This rank's tokens of t [B, S] (any dtype, any device): [B, 2c], chunks r and 2CP-1-r.
Tensor context_parallel_slice(const Tensor& t, int64_t cp_size, int64_t cp_rank);

// Sequence ranges of [B, S, ...] tensors (dimension 1) as packed tensors, and back.
Tensor seq_range(const Tensor& t, int64_t begin, int64_t end);        // -> [B, end - begin, ...]
void seq_assign(Tensor& dst, int64_t begin, const Tensor& src);        // dst[:, begin:begin+L] = src
void seq_accumulate(Tensor& dst, int64_t begin, const Tensor& src);    // dst[:, begin:begin+L] += src

}  // namespace moecore
