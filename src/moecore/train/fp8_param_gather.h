// --fp8-param-gather: the distributed optimizer's parameter all-gather of the FP8 linears' weights
// as FP8 codes (1 byte per element) instead of bf16 (2 bytes).
//
// The weights registered with the Fp8Context (model/fp8_linear.h, Fp8GatheredWeight) lie in the
// optimizer's flat bf16 weight buffers (dense, expert), each buffer sharded over its group (rank i
// owns [i S, (i+1) S)). After a step wrote its shard's bf16 weights, each rank quantises its own
// elements of every FP8 weight with the scale the whole matrix's quantisation would use:
//   tensorwise  amax of its piece of each matrix, all-reduced (Max) over the shard group and then
//               over the linear's amax group (TP / ETP): the amax of the whole tensor;
//   delayed     the stored scale (identical on every rank); the piece amaxes are reduced the same
//               way, for the history the forward records;
//   blockwise   per 128x128 block of each matrix, the amax of its piece of the block (the piece put
//               in a zero matrix: zeros change no amax), all-reduced (Max) over the shard group.
// Every rank then derives the same factors from the reduced amaxes (no factor travels), and the
// codes of the FP8 weights travel: one broadcast per owner of its FP8 elements, which are
// contiguous in a compact code buffer holding only the FP8 weights' elements in buffer order. The
// rest of the buffer (embeddings, norms, router, output layer, padding) is the optimizer's to
// gather in bf16 (other_ranges()). The codes equal those of quantising the whole bf16 weight, so
// the numerics equal a run without the flag bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/model/fp8_linear.h"
#include "moecore/model/params.h"

namespace moecore {

class Fp8ParamGather {
 public:
  struct Range {
    int64_t begin = 0, end = 0;
  };
  // Per step, per rank: elements gathered as FP8 codes (1 byte each) and as bf16 (2 bytes each),
  // and the bytes of the amaxes all-reduced over the shard group.
  struct Volume {
    int64_t fp8_elements = 0, bf16_elements = 0, amax_bytes = 0;
  };
  // Lays out the compact code buffers and the operands' views (after store.initialize()).
  Fp8ParamGather(ParamStore& store, Fp8Context& ctx);
  // The elements of buffer `expert` that are not FP8 weights (gathered in bf16 by the optimizer).
  const std::vector<Range>& other_ranges(bool expert) const { return kinds_[expert ? 1 : 0].other; }
  // Buffer `expert`'s FP8 weights: weights holds this rank's shard [begin, end) of the bf16
  // weights, fresh; shard = end - begin, group: the shard group (null: one rank). Afterwards every
  // registered weight of that buffer has a valid operand.
  void gather(bool expert, comm::Communicator* group, const Tensor& weights, int64_t begin, int64_t end);
  Volume volume() const {  // both buffers' last gathers
    return {dense_volume_.fp8_elements + expert_volume_.fp8_elements,
            dense_volume_.bf16_elements + expert_volume_.bf16_elements, dense_volume_.amax_bytes + expert_volume_.amax_bytes};
  }

 private:
  struct Entry {
    Fp8GatheredWeight* w;
    int64_t offset;   // in the flat buffer
    int64_t compact;  // in the compact code buffer
  };
  struct Kind {
    std::vector<Entry> entries;  // by offset
    std::vector<Range> other;
    Tensor codes;  // fp8 e4m3 [FP8 elements of the buffer]
    Tensor amax;   // f32: per matrix (per-tensor recipes) or per 128x128 block (blockwise)
    std::vector<int64_t> amax_at;  // per entry: its first amax element
  };
  int64_t compact_before(const Kind& k, int64_t pos) const;  // FP8 elements before buffer position pos
  // Matrix j of entry e: its piece in [begin, end) as matrix element range [a, b) (empty: a == b).
  std::pair<int64_t, int64_t> piece(const Entry& e, int64_t j, int64_t begin, int64_t end) const;
  Tensor zero_padded(const Entry& e, const Tensor& weights, int64_t j, int64_t a, int64_t b) const;
  void reduce_amaxes(Kind& k, comm::Communicator* group, const Tensor& weights, int64_t begin, int64_t end);
  void quantize_pieces(Kind& k, const Tensor& weights, int64_t begin, int64_t end);

  ParamStore& store_;
  Fp8Context& ctx_;
  Kind kinds_[2];
  Volume dense_volume_, expert_volume_;
};

}  // namespace moecore
