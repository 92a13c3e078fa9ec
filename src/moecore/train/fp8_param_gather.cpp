// --fp8-param-gather: each rank quantises its shard of the FP8 linears' weights with the whole
// matrices' scales and the codes are all-gathered (fp8_param_gather.h).
#include "moecore/train/fp8_param_gather.h"

#include <algorithm>

#include "moecore/ops/elementwise.h"
#include "moecore/ops/fp8_quant.h"

namespace moecore {

namespace {
constexpr int64_t kBlock = ops::kFp8BlockSize;
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

Fp8ParamGather::Fp8ParamGather(ParamStore& store, Fp8Context& ctx) : store_(store), ctx_(ctx) {
  const bool blockwise = ctx.config().recipe == Fp8Config::Recipe::Blockwise;
  const Device dev = store.device();
  for (const auto& g : ctx.gathered_weights()) {
    Kind& k = kinds_[g->weight->expert ? 1 : 0];
    k.entries.push_back({g.get(), store.grad_offset(*g->weight), 0});
  }
  for (bool expert : {false, true}) {
    Kind& k = kinds_[expert ? 1 : 0];
    std::sort(k.entries.begin(), k.entries.end(), [](const Entry& a, const Entry& b) { return a.offset < b.offset; });
    const int64_t size = (expert ? store.expert_grad_buffer() : store.grad_buffer()).numel();
    int64_t compact = 0, cursor = 0, amaxes = 0;
    for (Entry& e : k.entries) {
      const int64_t n = e.w->sets * e.w->out * e.w->in;
      if (e.offset > cursor) k.other.push_back({cursor, e.offset});
      cursor = e.offset + n;
      e.compact = compact;
      compact += n;
      k.amax_at.push_back(amaxes);
      amaxes += e.w->sets * (blockwise ? ceil_div(e.w->out, kBlock) * ceil_div(e.w->in, kBlock) : 1);
    }
    if (size > cursor) k.other.push_back({cursor, size});
    k.codes = Tensor::zeros({compact}, DType::FP8E4M3, dev);
    k.amax = Tensor::zeros({amaxes}, DType::F32, dev);
    for (size_t i = 0; i < k.entries.size(); ++i) {
      Fp8GatheredWeight& w = *k.entries[i].w;
      const int64_t mn = w.out * w.in;
      w.operands.assign(static_cast<size_t>(w.sets), ops::Fp8Tensor{});
      for (int64_t j = 0; j < w.sets; ++j) {
        ops::Fp8Tensor& op = w.operands[static_cast<size_t>(j)];
        op.data = k.codes.slice(0, k.entries[i].compact + j * mn, k.entries[i].compact + (j + 1) * mn).view({w.out, w.in});
        op.scaling = blockwise ? ops::Fp8Scaling::Block128 : ops::Fp8Scaling::PerTensor;
        op.scale_inv = blockwise ? Tensor::zeros({ceil_div(w.out, kBlock), ceil_div(w.in, kBlock)}, DType::F32, dev)
                                 : Tensor::zeros({1}, DType::F32, dev);
      }
      if (!blockwise) w.amax = k.amax.slice(0, k.amax_at[i], k.amax_at[i] + w.sets);
    }
  }
}

int64_t Fp8ParamGather::compact_before(const Kind& k, int64_t pos) const {
  int64_t n = 0;
  for (const Entry& e : k.entries) n += std::clamp<int64_t>(pos - e.offset, 0, e.w->sets * e.w->out * e.w->in);
  return n;
}

std::pair<int64_t, int64_t> Fp8ParamGather::piece(const Entry& e, int64_t j, int64_t begin, int64_t end) const {
  const int64_t mn = e.w->out * e.w->in, m0 = e.offset + j * mn;
  const int64_t a = std::clamp<int64_t>(begin - m0, 0, mn), b = std::clamp<int64_t>(end - m0, 0, mn);
  return {a, std::max(a, b)};
}

Tensor Fp8ParamGather::zero_padded(const Entry& e, const Tensor& weights, int64_t j, int64_t a, int64_t b) const {
  const int64_t mn = e.w->out * e.w->in, m0 = e.offset + j * mn;
  Tensor t = Tensor::zeros({e.w->out, e.w->in}, weights.dtype(), weights.device());
  if (b > a) {
    Tensor dst = t.view({mn}).slice(0, a, b);
    dst.copy_from(weights.slice(0, m0 + a, m0 + b));
  }
  return t;
}

void Fp8ParamGather::reduce_amaxes(Kind& k, comm::Communicator* group, const Tensor& weights, int64_t begin,
                                   int64_t end) {
  const bool blockwise = ctx_.config().recipe == Fp8Config::Recipe::Blockwise;
  ops::fill(k.amax, 0.0);
  for (size_t i = 0; i < k.entries.size(); ++i) {
    const Entry& e = k.entries[i];
    const int64_t per = blockwise ? ceil_div(e.w->out, kBlock) * ceil_div(e.w->in, kBlock) : 1;
    const int64_t mn = e.w->out * e.w->in;
    for (int64_t j = 0; j < e.w->sets; ++j) {
      const auto [a, b] = piece(e, j, begin, end);
      if (a == b) continue;  // zeros: nothing here
      Tensor dst = k.amax.slice(0, k.amax_at[i] + j * per, k.amax_at[i] + (j + 1) * per);
      if (blockwise) {
        dst.copy_from(ops::block_amax(zero_padded(e, weights, j, a, b)).view({per}));
      } else {
        const int64_t m0 = e.offset + j * mn;
        dst.copy_from(ops::amax_tensor(weights.slice(0, m0 + a, m0 + b)));
      }
    }
  }
  if (group && group->size() > 1 && k.amax.numel() > 0) group->all_reduce(k.amax, comm::ReduceOp::Max);
  if (ctx_.config().recipe != Fp8Config::Recipe::Tensorwise) return;
  for (const Entry& e : k.entries)  // the amax of the whole tensor over the linear's TP / ETP group
    if (e.w->amax_group && e.w->amax_group->size() > 1) e.w->amax_group->all_reduce(e.w->amax, comm::ReduceOp::Max);
}

void Fp8ParamGather::quantize_pieces(Kind& k, const Tensor& weights, int64_t begin, int64_t end) {
  const Fp8Config::Recipe recipe = ctx_.config().recipe;
  const bool blockwise = recipe == Fp8Config::Recipe::Blockwise;
  for (size_t i = 0; i < k.entries.size(); ++i) {
    const Entry& e = k.entries[i];
    const int64_t mn = e.w->out * e.w->in;
    for (int64_t j = 0; j < e.w->sets; ++j) {
      const auto [a, b] = piece(e, j, begin, end);
      ops::Fp8Tensor& op = e.w->operands[static_cast<size_t>(j)];
      ops::Fp8Tensor q;
      if (blockwise) {  // every matrix: its factors from the reduced block amaxes
        const int64_t per = op.scale_inv.numel(), at = k.amax_at[i] + j * per;
        q = ops::quantize_blocks(zero_padded(e, weights, j, a, b), k.amax.slice(0, at, at + per).view(op.scale_inv.shape()),
                                 ops::Fp8Format::E4M3);
        if (b > a) {
          Tensor dst = k.codes.slice(0, e.compact + j * mn + a, e.compact + j * mn + b);
          dst.copy_from(q.data.view({mn}).slice(0, a, b));
        }
      } else {  // the piece itself (or one zero, for the factor only), with the tensor's scale
        const int64_t m0 = e.offset + j * mn;
        const Tensor x = b > a ? weights.slice(0, m0 + a, m0 + b).view({1, b - a})
                               : Tensor::zeros({1, 1}, weights.dtype(), weights.device());
        const int64_t row = 3 * (e.w->first_set + j) + 1;  // the weight's delayed-scaling row
        q = recipe == Fp8Config::Recipe::Tensorwise
                ? ops::quantize_per_tensor(x, e.w->amax.slice(0, j, j + 1), ops::Fp8ScaleFrom::Amax, ops::Fp8Format::E4M3)
                : ops::quantize_per_tensor(x, e.w->scale->master.slice(0, row, row + 1), ops::Fp8ScaleFrom::Stored,
                                           ops::Fp8Format::E4M3);
        if (b > a) {
          Tensor dst = k.codes.slice(0, e.compact + j * mn + a, e.compact + j * mn + b);
          dst.copy_from(q.data.view({b - a}));
        }
      }
      op.scale_inv.copy_from(q.scale_inv);
    }
  }
}

void Fp8ParamGather::gather(bool expert, comm::Communicator* group, const Tensor& weights, int64_t begin, int64_t end) {
  Kind& k = kinds_[expert ? 1 : 0];
  const int64_t ranks = group ? group->size() : 1, size = end - begin;
  if (!k.entries.empty()) {
    reduce_amaxes(k, group, weights, begin, end);
    quantize_pieces(k, weights, begin, end);
  }
  if (ranks > 1 && k.codes.numel() > 0) {
    group->group_start();
    for (int owner = 0; owner < ranks; ++owner) {  // each owner's FP8 elements: contiguous in the compact buffer
      const int64_t lo = compact_before(k, owner * size), hi = compact_before(k, (owner + 1) * size);
      if (hi <= lo) continue;
      Tensor piece = k.codes.slice(0, lo, hi);
      group->broadcast(piece, owner);
    }
    group->group_end();
  }
  for (const Entry& e : k.entries) e.w->valid = true;
  Volume& v = expert ? expert_volume_ : dense_volume_;
  v = {};
  if (ranks <= 1) return;  // nothing travels
  v.fp8_elements = k.codes.numel();
  for (const Range& r : k.other) v.bf16_elements += r.end - r.begin;
  v.amax_bytes = k.amax.numel() * 4;
}

}  // namespace moecore
