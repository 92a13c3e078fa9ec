// Causal scaled-dot-product attention with grouped-query heads (GQA), forward and backward.
//
// Shapes (row-major, contiguous):
//   q, dq  [B, Sq, Hq, D]   k, dk  [B, Sk, Hkv, D]   v, dv  [B, Sk, Hkv, Dv]
//   out, dout  [B, Sq, Hq, Dv]   lse  [B, Hq, Sq]
// The value head dim Dv may differ from the query/key head dim D (Multi-Latent Attention:
// D = 192, Dv = 128); ordinary attention has Dv = D.
// with Sk >= Sq. Hq % Hkv == 0; query head h reads kv head h / (Hq / Hkv) (a group of Hq / Hkv
// query heads shares one kv head).
// Causal with bottom-right alignment (flash-attention's): the Sq queries are the LAST Sq
// positions of the Sk keys, so with o = Sk - Sq query s attends to keys t <= s + o. Sk == Sq
// is ordinary causal attention (t <= s). Sk > Sq is context parallelism: a rank holds the
// query chunk at global offset o and the keys [0, o + Sq) gathered from the other ranks.
//
// Forward, with c = softmax_scale (callers pass 1 / sqrt(D)):
//   s_t     = c * q_s . k_t                         for t <= s + o
//   lse_s   = log sum_{t<=s+o} exp(s_t)             (kept for the backward)
//   out_s   = sum_{t<=s+o} exp(s_t - lse_s) v_t
// Backward (flash-attention form; P recomputed from lse, nothing of size Sq x Sk is stored):
//   P  = exp(c Q K^T - lse) (0 where t > s + o)     dV = P^T dO   dP = dO V^T
//   Dr = rowsum(dO * O)   dS = P * (dP - Dr)        dQ = c dS K   dK = c dS^T Q
// Key t gets gradient from the queries s >= t - o (keys t <= o from every query).
// dk and dv of a kv head sum over the query heads of its group. dq, dk, dv are overwritten.
//
// Dtypes: q, k, v, out, dout, dq, dk, dv share one dtype: f32 or bf16 (CPU and CUDA), f64
// (CPU only, for gradient checks). lse is f32 (f64 for f64 inputs). Arithmetic is fp32 (f64
// for f64); bf16 rounding happens only when outputs are stored.
//
// Backends: the CPU evaluates the formulas row by row (OpenMP over (b, head, s)), any D and Dv.
// CUDA takes any D and Dv too (no size is refused) on three paths, all deterministic (no atomics):
//   flash (default where supported: bf16, (D, Dv) in {(64, 64), (96, 96), (128, 128),
//         (256, 256), (192, 128)}; any Sq <= Sk, any group) fused
//         flash-attention kernels on tensor cores (mma.sync m16n8k16 bf16 -> fp32, ldmatrix):
//         forward per (b, q head, 128-query tile) with online softmax over the 64-key tiles up
//         to the shifted diagonal; backward computes Dr, then dK/dV per (b, kv head, 64-key
//         tile) over the group's query heads and the query tiles that see it, and dQ per
//         (b, q head, 64-query tile) (key tiles of 32 from D = 192 on; at D = Dv = 256 dK and dV
//         are two launches, each recomputing P, and the forward re-reads Q from shared memory:
//         registers). Kernels are templated on (D, Dv). No Sq x Sk buffer. The forward's P is rounded to bf16
//         before P V; the backward's P and dS enter their products as hi + lo bf16 pairs
//         (MOECORE_ATTENTION_FLASH_SPLIT=0: one bf16 each, faster, less accurate); scores,
//         statistics and accumulation are fp32. At B4 Hq16 S2048 D128 about 3.2x (fwd) and
//         2.4x (bwd) faster than gemm (measured: docs/performance.md). See
//         attention_flash_cuda.cu. On compute capability 9.0 with D = Dv = 128 or MLA's
//         D = 192 / Dv = 128 (and an sm_90a build) the same path runs Hopper kernels instead
//         (TMA + wgmma, P and dS passed between products in registers; forward per query tile,
//         dK/dV per key tile, dQ per query tile, larger tiles, the same rounding), about 2.3x
//         (fwd) and 1.6x (bwd) faster than the mma.sync kernels at D = 128
//         (docs/performance.md). See attention_flash_hopper.cu; MOECORE_ATTENTION_FLASH_HOPPER=0
//         keeps the mma.sync ones.
//   gemm  (default where flash is not supported: f32 or bf16, D a multiple of 8, Dv = D, Sk <=
//         kAttentionGemmMaxSeq) cuBLAS
//         tensor-core GEMMs per (b, head) over block-lower-triangular causal blocks (shifted
//         right by o = Sk - Sq), with an fp32 score buffer [B*Hq, Sq, Sk] per call (chunked
//         over (b, h) to stay under MOECORE_ATTENTION_SCORE_MB, default 2048 MiB) and fused row kernels for the masked
//         softmax / lse (forward) and P, dS = P (dP - Dr) (backward; P recomputed from lse).
//         The forward's P is rounded to the input dtype before P V (bf16 for bf16 inputs);
//         the backward's P and dS enter their GEMMs as hi + lo bf16 pairs (fp32-accurate
//         gradients); scores, softmax statistics and accumulation are fp32;
//         dK/dV of a kv head sum the group's query heads in a fixed order. For f32 the GEMMs
//         run in true fp32 (no TF32). See attention_gemm_cuda.cu.
//   tiled (any D and Dv, f32 or bf16, any length) fused flash-attention kernels on CUDA
//         cores (fp32 FMA): one block per (b, q head,
//         64-query tile) with online softmax over the 64-key tiles it sees (up to s + o),
//         held in shared memory; backward computes Dr, then dQ per query tile and dK/dV per (key tile, kv head).
//         No Sq x Sk buffer; slower (CUDA cores, not tensor cores). D = Dv in {32, 64, 128}: kernels
//         templated on D with whole rows in shared memory (attention_cuda.cu); every other size:
//         runtime-sized kernels that sum scores over 32-column chunks and write 128 output columns
//         per block (more blocks for wider heads; attention_any_cuda.cu).
// The environment variable MOECORE_ATTENTION=auto|tiled|gemm|flash (read at every call)
// forces a path; auto (or unset) takes flash where supported, else gemm where supported, else
// tiled (which supports every size); gemm or flash where unsupported is an error.
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, Tensor& out,
                       Tensor& lse);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, double softmax_scale, Tensor& dq, Tensor& dk, Tensor& dv);

// Sizes as validated by the public functions. `seq` is the query length Sq; `kv_seq` the key /
// value length Sk >= Sq (the public functions always set it; 0, the default of a five-value
// initializer, means Sk = Sq); `v_head_dim` likewise (0 means Dv = D).
struct AttentionDims {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  int64_t kv_seq = 0;
  int64_t v_head_dim = 0;
  int64_t value_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }  // Dv
  int64_t group() const { return q_heads / kv_heads; }      // query heads per kv head
  int64_t keys() const { return kv_seq > 0 ? kv_seq : seq; }  // Sk
  int64_t offset() const { return keys() - seq; }            // o = Sk - Sq: query s sees keys t <= s + o
};

namespace cpu {
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out, Tensor& lse,
                       const AttentionDims& d);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionDims& d);
}  // namespace cpu
namespace cuda {
// The GEMM path's row kernels stage score rows (Sk long) in shared memory: Sk <= this.
inline constexpr int64_t kAttentionGemmMaxSeq = 16384;
enum class AttentionPath { Tiled, Gemm, Flash };
// The path the dispatcher takes for these sizes and this softmax scale (MOECORE_ATTENTION, else
// the auto choice).
AttentionPath attention_path(const AttentionDims& d, DType dtype, double scale);
bool attention_gemm_supported(const AttentionDims& d, DType dtype);
// The flash path: bf16, (D, Dv) in {(64, 64), (96, 96), (128, 128), (256, 256), (192, 128)} and a
// softmax scale > 0 (any Sq <= Sk, any GQA group).
// Its kernels keep the running row maximum of the unscaled scores, which is the maximum of the
// scaled ones only when the scale is positive; other scales take the gemm or tiled path.
bool attention_flash_supported(const AttentionDims& d, DType dtype, double scale);
// False when MOECORE_ATTENTION_FLASH_SPLIT=0 (the flash backward rounds dS to one bf16).
bool attention_flash_split_ds();
// Dispatchers: attention_path() chooses between the _tiled, _gemm and _flash implementations.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out, Tensor& lse,
                       const AttentionDims& d);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionDims& d);
void attention_forward_tiled(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out,
                             Tensor& lse, const AttentionDims& d);
void attention_backward_tiled(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv,
                              const AttentionDims& d);
// The tiled path's kernels for any D and Dv (attention_any_cuda.cu); attention_*_tiled send
// every size but D = Dv in {32, 64, 128} here.
void attention_forward_tiled_any(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out,
                                 Tensor& lse, const AttentionDims& d);
void attention_backward_tiled_any(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse, const Tensor& dout, double scale, Tensor& dq, Tensor& dk,
                                  Tensor& dv, const AttentionDims& d);
void attention_forward_gemm(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out,
                            Tensor& lse, const AttentionDims& d);
void attention_backward_gemm(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv,
                             const AttentionDims& d);
void attention_forward_flash(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out,
                             Tensor& lse, const AttentionDims& d);
void attention_backward_flash(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv,
                              const AttentionDims& d);
}  // namespace cuda

}  // namespace moecore::ops
