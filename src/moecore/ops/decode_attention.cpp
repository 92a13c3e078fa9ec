#include "moecore/ops/decode_attention.h"

#include "moecore/ops/attention.h"
#include "moecore/ops/common.h"
#include "moecore/ops/rope.h"

namespace moecore::ops {

namespace {

void check_decode(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                  const Tensor& v_cache, const Tensor& positions, const Tensor& out, const Tensor& lse) {
  const char* op = "decode_attention";
  for (const Tensor* t : {&q, &k_new, &v_new, &k_cache, &v_cache, &positions, &out, &lse}) check_contiguous(op, "tensor", *t);
  MC_CHECK(q.ndim() == 4 && q.size(1) == 1 && k_cache.ndim() == 4, op, ": q must be [R, 1, Hq, D], got ",
           shape_str(q.shape()), "; caches [R, max_len, Hkv, D], got ", shape_str(k_cache.shape()));
  check_dtype(op, "q", q, {DType::F32, DType::F64, DType::BF16});
  const int64_t R = q.size(0), Hq = q.size(2), D = q.size(3), Hkv = k_cache.size(2);
  MC_CHECK(v_cache.ndim() == 4 && v_cache.size(3) > 0, op, ": v_cache must be [R, max_len, Hkv, Dv], got ",
           shape_str(v_cache.shape()));
  const int64_t Dv = v_cache.size(3);
  MC_CHECK(k_cache.size(0) == R && k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0 &&
               v_cache.shape() == Shape({R, k_cache.size(1), Hkv, Dv}),
           op, ": caches ", shape_str(k_cache.shape()), " / ", shape_str(v_cache.shape()), " do not fit q ", shape_str(q.shape()));
  const Shape k_shape{R, 1, Hkv, D}, v_shape{R, 1, Hkv, Dv};
  MC_CHECK(k_new.shape() == k_shape && v_new.shape() == v_shape, op, ": k_new must be ", shape_str(k_shape),
           " and v_new ", shape_str(v_shape));
  MC_CHECK(out.shape() == Shape({R, 1, Hq, Dv}) && lse.shape() == Shape({R, Hq, 1}) && positions.shape() == Shape({R}) &&
               positions.dtype() == DType::I32,
           op, ": out must be [R, 1, Hq, Dv] = ", shape_str(Shape({R, 1, Hq, Dv})), ", lse [R, Hq, 1], positions [R] i32");
  for (const Tensor* t : {&k_new, &v_new, &k_cache, &v_cache, &out})
    MC_CHECK(t->dtype() == q.dtype() && t->device() == q.device(), op, ": every tensor must be ", dtype_name(q.dtype()),
             " on ", q.device().str());
  MC_CHECK(positions.device() == q.device() && lse.device() == q.device(), op, ": positions and lse on ", q.device().str());
}

// The per-row path: RoPE, the cache write and ops::attention_forward, row by row (positions read
// on the host).
void decode_attention_rows(Tensor& q, Tensor& k_new, const Tensor& v_new, Tensor& k_cache, Tensor& v_cache,
                           const std::vector<int32_t>& pos, bool rope, double rope_base, double scale, Tensor& out,
                           Tensor& lse) {
  const int64_t R = q.size(0), max_len = k_cache.size(1), Hkv = k_cache.size(2), D = q.size(3), Dv = v_cache.size(3);
  const Shape row_shape{max_len, Hkv, D}, v_row_shape{max_len, Hkv, Dv};
  for (int64_t r = 0; r < R; ++r) {
    const int64_t p = pos[static_cast<size_t>(r)], keys = p + 1;
    MC_CHECK(p >= 0 && p < max_len, "decode_attention: row ", r, " at position ", p, " outside the cache's ", max_len);
    Tensor qr = q.slice(0, r, r + 1), kr = k_new.slice(0, r, r + 1);
    if (rope) {
      rope_forward(qr, qr, rope_base, p);
      rope_forward(kr, kr, rope_base, p);
    }
    const Tensor k_row = k_cache.slice(0, r, r + 1).view(row_shape), v_row = v_cache.slice(0, r, r + 1).view(v_row_shape);
    k_row.slice(0, p, keys).view(kr.shape()).copy_from(kr);
    const Tensor vr = v_new.slice(0, r, r + 1);
    v_row.slice(0, p, keys).view(vr.shape()).copy_from(vr);
    Tensor out_r = out.slice(0, r, r + 1), lse_r = lse.slice(0, r, r + 1);
    attention_forward(qr, k_row.slice(0, 0, keys).view({1, keys, Hkv, D}),
                      v_row.slice(0, 0, keys).view({1, keys, Hkv, Dv}), scale, out_r, lse_r);
  }
}

}  // namespace

void decode_attention(Tensor& q, Tensor& k_new, const Tensor& v_new, Tensor& k_cache, Tensor& v_cache,
                      const Tensor& positions, bool rope, double rope_base, double scale, Tensor& out, Tensor& lse) {
  check_decode(q, k_new, v_new, k_cache, v_cache, positions, out, lse);
  const int64_t D = q.size(3), Dv = v_cache.size(3);
  if (q.device().is_cpu() || D % 2 != 0 || D > 256 || Dv > 256) {
    decode_attention_rows(q, k_new, v_new, k_cache, v_cache, positions.to_vector<int32_t>(), rope, rope_base, scale,
                          out, lse);
    return;
  }
  MC_CUDA_BACKEND("decode_attention",
                  cuda::decode_attention(q, k_new, v_new, k_cache, v_cache, positions, rope, rope_base, scale, out, lse));
}

}  // namespace moecore::ops
