// gpu tier: cross-entropy, embedding, AdamW and split fp32 masters on CUDA held to their CPU ops (op_harness),
// plus the out-of-range index errors raised from the device flags, and the vocabulary-parallel
// parts of both (cross_entropy.h's recipe, embedding parts).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "moecore/core/device.h"
#include "moecore/ops/adamw.h"
#include "moecore/ops/common.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/cross_entropy.h"
#include "moecore/ops/embedding.h"
#include "moecore/ops/master_split.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {
const Device kCuda = Device::cuda(0);

// Random ints in [0, bound), with every `ignore_every`-th set to -1 (0: none).
Tensor random_indices(int64_t n, int64_t bound, int ignore_every = 0) {
  std::mt19937_64 gen(fresh_seed());
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[i] = (ignore_every > 0 && i % ignore_every == 2) ? -1 : static_cast<int32_t>(gen() % bound);
  return Tensor::from_vector(v, {n});
}

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& i) { return dtype_name(i.param); }
}  // namespace

// ---- cross-entropy --------------------------------------------------------------------
class GpuCrossEntropy : public ::testing::TestWithParam<DType> {};

TEST_P(GpuCrossEntropy, ForwardAndBackwardMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  // lse (up to ~20): fp32 tree sums on CUDA vs double sums on the CPU, then one fp32 rounding:
  // a few 1e-6 absolute. dlogits = dloss * (exp(x - lse) - [target]): the lse error moves p by
  // ~2e-6 relative, which is ~4e-6 absolute at p ~ 1 with |dloss| <= 2 (hence atol 1e-5);
  // bf16 dlogits may also round the other way (2^-8 relative).
  const Tolerance row_tol{1e-5, 1e-5};
  const Tolerance grad_tol = t == DType::F32 ? Tolerance{1e-5, 1e-4} : Tolerance{1e-5, 1e-2};
  for (int64_t classes : {7, 1000, 151936}) {
    const int64_t rows = classes > 100000 ? 6 : 33;
    Tensor logits = random_tensor({rows, classes}, t, Device::cpu(), -8.0, 8.0);
    Tensor targets = random_indices(rows, classes, 5);
    Tensor dloss = random_tensor({rows}, DType::F32, Device::cpu(), -2.0, 2.0);
    const OutputSpec row_spec{{rows}, DType::F32}, grad_spec{{rows, classes}, t};
    expect_cuda_matches_cpu({logits, targets, dloss}, {row_spec, row_spec, grad_spec},
                            [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::cross_entropy_forward(in[0], in[1], out[0], out[1]);
                              ops::cross_entropy_backward(in[0], in[1], out[1], in[2], out[2]);
                            },
                            {row_tol, row_tol, grad_tol});
    // In place: dlogits is a copy of the logits, overwritten by their gradient.
    expect_cuda_matches_cpu({logits, targets, dloss}, {row_spec, row_spec, grad_spec},
                            [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::cross_entropy_forward(in[0], in[1], out[0], out[1]);
                              out[2].copy_from(in[0]);
                              ops::cross_entropy_backward(out[2], in[1], out[1], in[2], out[2]);
                            },
                            {row_tol, row_tol, grad_tol});
    if (HasFailure()) FAIL() << "classes = " << classes;
  }
}

// The one-pass op (bf16 with V % 8 == 0: the fused kernel; 7 classes and f32: the two kernels)
// against the CPU's forward + backward. Same tolerances as above: the fused kernel's fast
// exponentials are within ~2 ulp, below the lse's fp32 summation error.
TEST_P(GpuCrossEntropy, ForwardBackwardInOnePassMatchesCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const Tolerance row_tol{1e-5, 1e-5};
  const Tolerance grad_tol = t == DType::F32 ? Tolerance{1e-5, 1e-4} : Tolerance{1e-5, 1e-2};
  for (int64_t classes : {7, 1000, 32768, 151936}) {
    const int64_t rows = classes > 100000 ? 6 : 33;
    Tensor logits = random_tensor({rows, classes}, t, Device::cpu(), -8.0, 8.0);
    Tensor targets = random_indices(rows, classes, 5);
    Tensor dloss = random_tensor({rows}, DType::F32, Device::cpu(), -2.0, 2.0);
    const OutputSpec row_spec{{rows}, DType::F32}, grad_spec{{rows, classes}, t};
    expect_cuda_matches_cpu({logits, targets, dloss}, {row_spec, row_spec, grad_spec},
                            [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::cross_entropy_forward_backward(in[0], in[1], in[2], out[0], out[1], out[2]);
                            },
                            {row_tol, row_tol, grad_tol});
    expect_cuda_matches_cpu({logits, targets, dloss}, {row_spec, row_spec, grad_spec},
                            [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              out[2].copy_from(in[0]);  // in place
                              ops::cross_entropy_forward_backward(out[2], in[1], in[2], out[0], out[1], out[2]);
                            },
                            {row_tol, row_tol, grad_tol});
    if (HasFailure()) FAIL() << "classes = " << classes;
  }
  // In place on many rows: the same loss, lse and gradient bit for bit as out of place, every
  // time (the loss reads the target's logit, which the row's own gradient pass overwrites).
  {
    const int64_t rows = 4096, classes = 4096;
    Tensor logits = random_tensor({rows, classes}, t, kCuda, -8.0, 8.0);
    const Tensor targets = random_indices(rows, classes, 7).to(kCuda);
    const Tensor dloss = random_tensor({rows}, DType::F32, kCuda, -2.0, 2.0);
    Tensor loss = Tensor::empty({rows}, DType::F32, kCuda), lse = Tensor::empty({rows}, DType::F32, kCuda);
    Tensor grad = Tensor::empty(logits.shape(), t, kCuda);
    ops::cross_entropy_forward_backward(logits, targets, dloss, loss, lse, grad);
    const std::vector<float> want_loss = loss.to_vector<float>(), want_lse = lse.to_vector<float>();
    const Tensor want_grad = grad.to(Device::cpu());
    for (int rep = 0; rep < 5; ++rep) {
      Tensor in_place = logits.clone();
      ops::cross_entropy_forward_backward(in_place, targets, dloss, loss, lse, in_place);
      ASSERT_EQ(loss.to_vector<float>(), want_loss) << "in-place loss, repetition " << rep;
      ASSERT_EQ(lse.to_vector<float>(), want_lse) << "repetition " << rep;
      ASSERT_EQ(to_doubles(in_place.to(Device::cpu())), to_doubles(want_grad)) << "repetition " << rep;
    }
  }
  // A bad target: the error names the op, as the two ops' errors do.
  Tensor logits = random_tensor({8, 1000}, t, kCuda);
  Tensor targets = Tensor::from_vector<int32_t>({1, 2, -1, 3, 1000, 4, 5, 6}, {8}).to(kCuda);
  Tensor loss = Tensor::empty({8}, DType::F32, kCuda), lse = Tensor::empty({8}, DType::F32, kCuda);
  Tensor dloss = Tensor::zeros({8}, DType::F32, kCuda);
  try {
    ops::cross_entropy_forward_backward(logits, targets, dloss, loss, lse, logits);
    FAIL() << "target 1000 with 1000 classes was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cross_entropy_forward_backward: targets[4] = 1000 is out of range for "
                                         "1000 classes"),
              std::string::npos)
        << e.what();
  }
}

// NaN logits give a NaN loss and a NaN gradient row on both paths, wherever they sit: row 0 has
// its first 8 columns NaN (a whole 16-byte vector of the one-pass kernel, and the first value of
// 8 threads of the forward kernel: a maximum compared with the empty start alone skipped them),
// row 1 one NaN in its last column, row 3 one NaN in column 192 (with 200 classes the forward
// kernel's thread 192 first meets lane 208, which has no column: fmaxf dropped the NaN there),
// row 4 is -inf but for a NaN in column 7 (fmaxf over the one-pass kernel's vector gave -inf,
// and the sum skipped it); row 2 is finite and stays so. The CPU ops agree.
TEST_P(GpuCrossEntropy, NanLogitsGiveNanLossAndGradient) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const int64_t rows = 5;
  for (const int64_t classes : {1024, 200}) {
    SCOPED_TRACE(std::to_string(classes) + " classes");
    Tensor host = random_tensor({rows, classes}, DType::F32, Device::cpu(), -4.0, 4.0);
    float* x = host.data<float>();
    for (int c = 0; c < 8; ++c) x[c] = std::nanf("");
    x[classes + classes - 1] = std::nanf("");
    x[3 * classes + 192] = std::nanf("");
    for (int64_t c = 0; c < classes; ++c) x[4 * classes + c] = c == 7 ? std::nanf("") : -INFINITY;
    const Tensor logits = ops::cast_to(host, t);
    const Tensor targets = Tensor::from_vector<int32_t>({3, 5, 7, 9, 11}, {rows});
    const Tensor dloss = Tensor::from_vector<float>({1.0f, 1.0f, 1.0f, 1.0f, 1.0f}, {rows});
    for (const Device dev : {Device::cpu(), kCuda}) {
      for (bool one_pass : {false, true}) {
        SCOPED_TRACE(std::string(dev.is_cpu() ? "cpu" : "cuda") + (one_pass ? " one pass" : " two ops"));
        const Tensor l = logits.to(dev), tg = targets.to(dev), dl = dloss.to(dev);
        Tensor loss = Tensor::empty({rows}, DType::F32, dev), lse = Tensor::empty({rows}, DType::F32, dev);
        Tensor grad = Tensor::empty({rows, classes}, t, dev);
        if (one_pass) {
          ops::cross_entropy_forward_backward(l, tg, dl, loss, lse, grad);
        } else {
          ops::cross_entropy_forward(l, tg, loss, lse);
          ops::cross_entropy_backward(l, tg, lse, dl, grad);
        }
        const std::vector<float> lv = loss.to_vector<float>();
        const std::vector<double> g = to_doubles(grad.to(Device::cpu()));
        for (int64_t r = 0; r < rows; ++r) {
          const bool finite = r == 2;
          EXPECT_EQ(std::isfinite(lv[r]), finite) << "loss of row " << r << ": " << lv[r];
          if (!finite) EXPECT_TRUE(std::isnan(lv[r])) << "loss of row " << r << ": " << lv[r];
          int64_t nan = 0;
          for (int64_t c = 0; c < classes; ++c) nan += std::isnan(g[r * classes + c]) ? 1 : 0;
          EXPECT_EQ(nan, finite ? 0 : classes) << "NaN gradients in row " << r;
        }
      }
    }
  }
}

TEST_P(GpuCrossEntropy, OutOfRangeTargetIsAnError) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  Tensor logits = random_tensor({8, 100}, t, kCuda);
  Tensor targets = Tensor::from_vector<int32_t>({1, 2, -1, 3, 100, 4, 250, 5}, {8}).to(kCuda);
  Tensor loss = Tensor::empty({8}, DType::F32, kCuda), lse = Tensor::empty({8}, DType::F32, kCuda);
  try {
    ops::cross_entropy_forward(logits, targets, loss, lse);
    FAIL() << "target 100 with 100 classes was accepted on CUDA";
  } catch (const Error& e) {
    // The first bad row is reported, as on the CPU.
    EXPECT_STREQ(e.what(),
                 "cross_entropy_forward: targets[4] = 100 is out of range for 100 classes (expected 0 <= target < "
                 "100, or negative to ignore the row)");
  }
  Tensor dloss = Tensor::zeros({8}, DType::F32, kCuda), dx = Tensor::empty({8, 100}, t, kCuda);
  try {
    ops::cross_entropy_backward(logits, targets, lse, dloss, dx);
    FAIL() << "backward accepted target 100 with 100 classes on CUDA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cross_entropy_backward: targets[4] = 100"), std::string::npos) << e.what();
  }
  // The device is still usable: a valid call succeeds afterwards.
  Tensor good = Tensor::from_vector<int32_t>({1, 2, -1, 3, 99, 4, 0, 5}, {8}).to(kCuda);
  ops::cross_entropy_forward(logits, good, loss, lse);
  EXPECT_TRUE(all_written(loss));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuCrossEntropy, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

// ---- embedding ------------------------------------------------------------------------
class GpuEmbedding : public ::testing::TestWithParam<DType> {};

TEST_P(GpuEmbedding, ForwardAndBackwardMatchCpuBitForBit) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  struct Case {
    int64_t vocab, hidden, tokens, distinct;
  };
  // Heavy repetition (ids from 40 rows), a hidden size over several column chunks, and the
  // full Qwen vocabulary (all radix-sort bits in play).
  for (const Case c : {Case{1000, 300, 517, 40}, Case{151936, 64, 4096, 151936}, Case{50, 1030, 64, 3}}) {
    Tensor table = random_tensor({c.vocab, c.hidden}, t);
    Tensor ids = random_indices(c.tokens, c.distinct);
    Tensor dout = random_tensor({c.tokens, c.hidden}, t);
    Tensor dtable0 = random_tensor({c.vocab, c.hidden}, DType::F32);
    // Both devices add each row's gradients in increasing t in fp32: identical results.
    expect_cuda_matches_cpu({table, ids, dout, dtable0}, {{{c.tokens, c.hidden}, t}, {{c.vocab, c.hidden}, DType::F32}},
                            [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::embedding_forward(in[0], in[1], out[0]);
                              out[1].copy_from(in[3]);
                              ops::embedding_backward(in[1], in[2], out[1]);
                            },
                            {Tolerance{0.0, 0.0}});
    if (HasFailure()) FAIL() << "vocab " << c.vocab << " hidden " << c.hidden << " tokens " << c.tokens;
  }
}

TEST_P(GpuEmbedding, OutOfRangeIdIsAnError) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  Tensor table = random_tensor({10, 8}, t, kCuda);
  Tensor ids = Tensor::from_vector<int32_t>({0, 9, 10, -2}, {4}).to(kCuda);
  Tensor out = Tensor::empty({4, 8}, t, kCuda);
  try {
    ops::embedding_forward(table, ids, out);
    FAIL() << "id 10 with 10 rows was accepted on CUDA";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "embedding_forward: ids[2] = 10 is out of range for a vocabulary of 10 rows (expected 0 <= id < 10)");
  }
  Tensor dtable = Tensor::zeros({10, 8}, DType::F32, kCuda);
  Tensor dout = random_tensor({4, 8}, t, kCuda);
  EXPECT_THROW(ops::embedding_backward(ids, dout, dtable), Error);
  for (float v : dtable.to_vector<float>()) ASSERT_EQ(v, 0.0f) << "dtable was modified before the error";
}

// Inside ops::EmbeddingIdsValidated (the model's backward: its forward checked the same ids) the
// backward does not wait for the range flag, and gives the same bits; ids out of range there are
// skipped (key = "other part"), never written out of bounds.
TEST_P(GpuEmbedding, ValidatedIdsBackwardDoesNotWait) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  Tensor ids = random_indices(300, 50).to(kCuda);
  Tensor dout = random_tensor({300, 24}, t, kCuda);
  Tensor checked = Tensor::zeros({50, 24}, DType::F32, kCuda), trusted = Tensor::zeros({50, 24}, DType::F32, kCuda);
  synchronize(kCuda);
  uint64_t before = host_synchronizations();
  ops::embedding_backward(ids, dout, checked);
  EXPECT_EQ(host_synchronizations() - before, 1u) << "the unscoped backward reads its range flag";
  before = host_synchronizations();
  {
    const ops::EmbeddingIdsValidated scope;
    ops::embedding_backward(ids, dout, trusted);
  }
  EXPECT_EQ(host_synchronizations(), before) << "the validated backward waited";
  EXPECT_EQ(trusted.to_vector<float>(), checked.to_vector<float>());
  Tensor bad_ids = Tensor::from_vector<int32_t>({0, 9, 10, -2}, {4}).to(kCuda);
  Tensor small = Tensor::zeros({10, 8}, DType::F32, kCuda), ones = Tensor::empty({4, 8}, t, kCuda);
  ops::fill(ones, 1.0);
  {
    const ops::EmbeddingIdsValidated scope;
    ops::embedding_backward(bad_ids, ones, small);
  }
  const std::vector<float> rows = small.to_vector<float>();
  for (int64_t r = 0; r < 10; ++r)
    for (int64_t c = 0; c < 8; ++c)
      EXPECT_EQ(rows[static_cast<size_t>(r * 8 + c)], r == 0 || r == 9 ? 1.0f : 0.0f) << "row " << r;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuEmbedding, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

// ---- vocabulary-parallel parts (cross-entropy and embedding) ------------------------------
class GpuVocabParallel : public ::testing::TestWithParam<DType> {};

// The cross_entropy.h recipe on each device (communication emulated: lse_part rows copied
// into [P, T], target logits summed on the host in part order): part_forward, combine,
// combined_loss, and each part's backward with the combined lse (part 1 in place).
TEST_P(GpuVocabParallel, CrossEntropyRecipeMatchesCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  // As GpuCrossEntropy: fp32 tree sums vs double sums, ~1e-6 absolute on lse; the loss is
  // lse - target_logit, a few 1e-6 absolute more.
  const Tolerance row_tol{1e-5, 1e-5};
  const Tolerance grad_tol = t == DType::F32 ? Tolerance{1e-5, 1e-4} : Tolerance{1e-5, 1e-2};
  for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{0, 5, 19, 37}, std::vector<int64_t>{0, 333, 700, 1000},
                                             std::vector<int64_t>{0, 50000, 100001, 151936}}) {
    const int64_t total = bounds.back(), rows = total > 100000 ? 6 : 33;
    Tensor logits = random_tensor({rows, total}, t, Device::cpu(), -8.0, 8.0);
    std::vector<Tensor> inputs;
    std::vector<OutputSpec> outputs{{{3, rows}, DType::F32}, {{rows}, DType::F32}, {{rows}, DType::F32},
                                    {{rows}, DType::F32}};
    for (int p = 0; p < 3; ++p) {
      inputs.push_back(logits.slice(1, bounds[p], bounds[p + 1]).contiguous());
      outputs.push_back({{rows, bounds[p + 1] - bounds[p]}, t});
    }
    inputs.push_back(random_indices(rows, total, 5));
    inputs.push_back(random_tensor({rows}, DType::F32, Device::cpu(), -2.0, 2.0));
    // outputs: 0 parts [P, T], 1 summed target logits, 2 lse, 3 loss, 4.. each part's dlogits
    expect_cuda_matches_cpu(
        inputs, outputs,
        [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
          const Device dev = in[0].device();
          const Tensor& targets = in[3];
          std::vector<float> target_sum(static_cast<size_t>(rows), 0.0f);
          for (int p = 0; p < 3; ++p) {
            Tensor lse_part = Tensor::empty({rows}, DType::F32, dev), tl = Tensor::empty({rows}, DType::F32, dev);
            ops::cross_entropy_part_forward(in[p], targets, bounds[p], total, lse_part, tl);
            out[0].slice(0, p, p + 1).copy_from(lse_part.view({1, rows}));
            const std::vector<float> v = tl.to_vector<float>();
            for (int64_t r = 0; r < rows; ++r) target_sum[r] += v[r];
          }
          out[1].copy_from(Tensor::from_vector(target_sum, {rows}));
          ops::logsumexp_combine(out[0], out[2]);
          ops::cross_entropy_combined_loss(out[2], out[1], targets, out[3]);
          for (int p = 0; p < 3; ++p) {
            if (p == 1) {
              out[4 + p].copy_from(in[p]);
              ops::cross_entropy_backward(out[4 + p], targets, out[2], in[4], out[4 + p], bounds[p], total);
            } else {
              ops::cross_entropy_backward(in[p], targets, out[2], in[4], out[4 + p], bounds[p], total);
            }
          }
        },
        {row_tol, row_tol, row_tol, row_tol, grad_tol, grad_tol, grad_tol});
    if (HasFailure()) FAIL() << "vocabulary " << total;
  }
}

// logsumexp_combine on its own, over a wide range and with empty (-inf) parts.
TEST(GpuVocabParallelCombine, LogsumexpCombineMatchesCpu) {
  MC_REQUIRE_CUDA();
  const int64_t num_parts = 8, rows = 1000;
  std::vector<float> v = random_tensor({num_parts, rows}, DType::F32, Device::cpu(), -80.0, 80.0).to_vector<float>();
  for (int64_t r = 0; r < rows; r += 7) v[r] = -INFINITY;  // part 0 empty on some rows
  for (int64_t p = 0; p < num_parts; ++p) v[p * rows + 3] = -INFINITY;  // row 3: every part empty
  expect_cuda_matches_cpu({Tensor::from_vector(v, {num_parts, rows})}, {{{rows}, DType::F32}},
                          [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                            ops::logsumexp_combine(in[0], out[0]);
                          },
                          {Tolerance{1e-5, 1e-6}});
}

// A NaN part makes its row NaN wherever it sits (fmaxf alone would skip it), as on the CPU.
TEST(GpuVocabParallelCombine, NanPartGivesNanRow) {
  MC_REQUIRE_CUDA();
  const float nan = std::nanf(""), inf = INFINITY;
  const Tensor parts = Tensor::from_vector<float>({nan, -inf, inf, 2.0f, nan, 3.0f, nan, 4.0f, -inf, nan, 1.0f, 5.0f},
                                                  {3, 4});
  Tensor lse = Tensor::empty({4}, DType::F32, kCuda);
  ops::logsumexp_combine(parts.to(kCuda), lse);
  const std::vector<float> l = lse.to_vector<float>();
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(std::isnan(l[r])) << "row " << r << ": " << l[r];
  EXPECT_NEAR(l[3], 5.0f + std::log(1.0f + std::exp(-1.0f) + std::exp(-3.0f)), 1e-5f) << "row 3 has no NaN";
}

// A NaN in a part's logits makes its lse_part NaN wherever it sits (column 0: the first value
// of thread 0 was skipped against the empty start; column 192 of 200: fmaxf dropped it against
// an empty lane), and the combined lse and loss NaN, as on the CPU; other rows stay finite.
TEST_P(GpuVocabParallel, NanInPartGivesNanLse) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const int64_t rows = 3, classes = 200, total = 2 * classes;
  Tensor host = random_tensor({rows, classes}, DType::F32, Device::cpu(), -4.0, 4.0);
  host.data<float>()[0] = std::nanf("");
  host.data<float>()[classes + 192] = std::nanf("");
  const Tensor part0 = ops::cast_to(host, t);
  const Tensor part1 = random_tensor({rows, classes}, t, Device::cpu(), -4.0, 4.0);
  const Tensor targets = Tensor::from_vector<int32_t>({1, 250, 3}, {rows});
  for (const Device dev : {Device::cpu(), kCuda}) {
    SCOPED_TRACE(dev.is_cpu() ? "cpu" : "cuda");
    Tensor parts = Tensor::empty({2, rows}, DType::F32, dev), target_logit = Tensor::zeros({rows}, DType::F32, dev);
    int p = 0;
    for (const Tensor* logits : {&part0, &part1}) {
      Tensor lse_part = Tensor::empty({rows}, DType::F32, dev), tl = Tensor::empty({rows}, DType::F32, dev);
      ops::cross_entropy_part_forward(logits->to(dev), targets.to(dev), p * classes, total, lse_part, tl);
      const std::vector<float> v = lse_part.to_vector<float>();
      for (int64_t r = 0; r < rows; ++r)
        EXPECT_EQ(std::isnan(v[r]), p == 0 && r < 2) << "lse_part of part " << p << " row " << r << ": " << v[r];
      parts.slice(0, p, p + 1).copy_from(lse_part.view({1, rows}));
      ++p;
    }
    Tensor lse = Tensor::empty({rows}, DType::F32, dev), loss = Tensor::empty({rows}, DType::F32, dev);
    ops::logsumexp_combine(parts, lse);
    ops::cross_entropy_combined_loss(lse, target_logit, targets.to(dev), loss);
    const std::vector<float> l = lse.to_vector<float>(), lv = loss.to_vector<float>();
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(std::isnan(l[r]), r < 2) << "lse of row " << r << ": " << l[r];
      EXPECT_EQ(std::isnan(lv[r]), r < 2) << "loss of row " << r << ": " << lv[r];
    }
  }
}

TEST_P(GpuVocabParallel, PartTargetOutOfRangeIsAnError) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  Tensor logits = random_tensor({4, 10}, t, kCuda);  // classes [20, 30) of 37
  Tensor targets = Tensor::from_vector<int32_t>({36, -1, 37, 0}, {4}).to(kCuda);
  Tensor lse_part = Tensor::empty({4}, DType::F32, kCuda), tl = Tensor::empty({4}, DType::F32, kCuda);
  try {
    ops::cross_entropy_part_forward(logits, targets, 20, 37, lse_part, tl);
    FAIL() << "target 37 with 37 classes was accepted on CUDA";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "cross_entropy_part_forward: targets[2] = 37 is out of range for 37 classes (expected 0 <= target < "
                 "37, or negative to ignore the row)");
  }
  Tensor dloss = Tensor::zeros({4}, DType::F32, kCuda), dx = Tensor::empty({4, 10}, t, kCuda);
  EXPECT_THROW(ops::cross_entropy_backward(logits, targets, lse_part, dloss, dx, 20, 37), Error);
  Tensor table = random_tensor({10, 8}, t, kCuda), out = Tensor::empty({4, 8}, t, kCuda);
  EXPECT_THROW(ops::embedding_forward(table, targets, out, 20, 37), Error);
}

// A part of the embedding table: ids over the whole vocabulary, most of them in other parts
// (zero rows, no gradient); the backward is bit-identical to the CPU as for the whole table.
TEST_P(GpuVocabParallel, EmbeddingPartMatchesCpuBitForBit) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  struct Case {
    int64_t start, rows, total, hidden, tokens, distinct;
  };
  for (const Case c : {Case{300, 350, 1000, 300, 517, 1000}, Case{75968, 75968, 151936, 64, 4096, 151936},
                       Case{0, 20, 50, 1030, 64, 25}, Case{10, 3, 13, 40, 100, 13}}) {
    Tensor table = random_tensor({c.rows, c.hidden}, t);
    Tensor ids = random_indices(c.tokens, c.distinct);
    Tensor dout = random_tensor({c.tokens, c.hidden}, t);
    Tensor dtable0 = random_tensor({c.rows, c.hidden}, DType::F32);
    expect_cuda_matches_cpu({table, ids, dout, dtable0}, {{{c.tokens, c.hidden}, t}, {{c.rows, c.hidden}, DType::F32}},
                            [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::embedding_forward(in[0], in[1], out[0], c.start, c.total);
                              out[1].copy_from(in[3]);
                              ops::embedding_backward(in[1], in[2], out[1], c.start, c.total);
                            },
                            {Tolerance{0.0, 0.0}});
    if (HasFailure()) FAIL() << "part [" << c.start << ", " << c.start + c.rows << ") of " << c.total;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuVocabParallel, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

// ---- AdamW (f32 master weights) -------------------------------------------------------
// Three steps (the second with a clip scale of 0.5) from the same random state on both devices;
// the moments in `moments` (f32, or bf16 for the precision-aware optimizer), second moments
// drawn from [v_lo, 0.01].
static void expect_adamw_steps_match_cpu(DType moments, double v_lo, const std::vector<Tolerance>& tolerances) {
  const int64_t n = 100003;
  Tensor p = random_tensor({n}, DType::F32), m = random_tensor({n}, moments, Device::cpu(), -0.1, 0.1);
  Tensor v = random_tensor({n}, moments, Device::cpu(), v_lo, 0.01);  // second moments are >= 0
  Tensor g = random_tensor({n}, DType::F32, Device::cpu(), -3.0, 3.0);
  expect_cuda_matches_cpu({p, g, m, v}, {{{n}, DType::F32}, {{n}, moments}, {{n}, moments}},
                          [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                            out[0].copy_from(in[0]);
                            out[1].copy_from(in[2]);
                            out[2].copy_from(in[3]);
                            for (int64_t step = 1; step <= 3; ++step)
                              ops::adamw_step(out[0], in[1], out[1], out[2], {1e-3, 0.9, 0.95, 1e-8, 0.1, step},
                                              step == 2 ? 0.5f : 1.0f);
                          },
                          tolerances);
}

TEST(GpuAdamW, ThreeStepsMatchCpu) {
  MC_REQUIRE_CUDA();
  // nvcc may fuse multiply-adds the host compiler leaves separate: last-bit differences.
  expect_adamw_steps_match_cpu(DType::F32, 0.0, {Tolerance{1e-6, 1e-5}});
}

// bf16 moments (the precision-aware optimizer): the same per-element function and the same
// rounding on store on both devices.
TEST(GpuAdamW, Bf16MomentsMatchCpu) {
  MC_REQUIRE_CUDA();
  // v >= 1e-3 keeps m / sqrt(v) (the update's size) bounded: <= ~6.5e-3 a step here.
  // Last-bit f32 differences (nvcc fuses multiply-adds) can flip a bf16 rounding of a stored
  // moment by one unit (up to 2^-7 relative); later steps carry it on: in m as an absolute
  // ~2e-3 (m's values reach ~0.4 and later gradients can cancel them), in v as <= 2 units
  // relative (v only grows by positive terms), in p as <= 0.8% of the <= 6.5e-3 updates of
  // steps 2 and 3. A misread or unrounded moment is off by orders of magnitude more.
  expect_adamw_steps_match_cpu(DType::BF16, 1e-3, {Tolerance{3e-4, 1e-5}, Tolerance{3e-3, 8e-3}, Tolerance{1e-6, 2e-2}});
}

// The fused compute-weight write on the GPU: bit for bit the cast of the updated master.
TEST(GpuAdamW, ComputeWeightIsTheCastOfTheUpdatedParam) {
  MC_REQUIRE_CUDA();
  const int64_t n = 100003;
  Tensor p = random_tensor({n}, DType::F32, kCuda), g = random_tensor({n}, DType::F32, kCuda, -3.0, 3.0);
  Tensor m = Tensor::zeros({n}, DType::BF16, kCuda), v = Tensor::zeros({n}, DType::F32, kCuda);
  Tensor w = Tensor::zeros({n}, DType::BF16, kCuda);
  for (int64_t step = 1; step <= 2; ++step) ops::adamw_step(p, g, m, v, {1e-3, 0.9, 0.95, 1e-8, 0.1, step}, 1.0f, &w);
  Tensor cast = Tensor::empty({n}, DType::BF16, kCuda);
  ops::cast(p, cast);
  EXPECT_EQ(to_doubles(w), to_doubles(cast));
}

TEST(GpuAdamW, F64IsRefusedOnCuda) {
  MC_REQUIRE_CUDA();
  Tensor p = Tensor::zeros({4}, DType::F64, kCuda), g = p.clone(), m = p.clone(), v = p.clone();
  try {
    ops::adamw_step(p, g, m, v, {1e-3, 0.9, 0.95, 1e-8, 0.1, 1});
    FAIL() << "f64 AdamW ran on CUDA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f64 is CPU-only"), std::string::npos) << e.what();
  }
}

// ---- split fp32 masters (the default with --bf16) -------------------------------------
// Split and join are bit operations: the GPU gives the CPU's halves and floats exactly, for
// floats of every exponent and both signs (random bit patterns, NaNs left out).
TEST(GpuMasterSplit, SplitAndJoinMatchCpuBitForBit) {
  MC_REQUIRE_CUDA();
  const int64_t n = 1 << 20;
  std::mt19937_64 gen(fresh_seed());
  std::vector<float> xs;
  while (static_cast<int64_t>(xs.size()) < n) {
    const float x = bits_float(static_cast<uint32_t>(gen()));
    if (!std::isnan(x)) xs.push_back(x);
  }
  const Tensor master = Tensor::from_vector(xs, {n});
  Tensor high = Tensor::empty({n}, DType::BF16), remainder = Tensor::empty({n}, DType::I16);
  ops::split_master(master, high, remainder);
  Tensor master_gpu = master.to(kCuda);
  Tensor high_gpu = Tensor::empty({n}, DType::BF16, kCuda), remainder_gpu = Tensor::empty({n}, DType::I16, kCuda);
  ops::split_master(master_gpu, high_gpu, remainder_gpu);
  EXPECT_EQ(to_doubles(high_gpu), to_doubles(high));
  EXPECT_EQ(to_doubles(remainder_gpu), to_doubles(remainder));
  Tensor joined_gpu = Tensor::empty({n}, DType::F32, kCuda);
  ops::join_master(high_gpu, remainder_gpu, joined_gpu);
  EXPECT_EQ(std::memcmp(joined_gpu.to(Device::cpu()).data_ptr(), master.data_ptr(), master.nbytes()), 0);
}

// AdamW on the halves: three steps (the second clipped) on both devices; the joined masters agree
// as ThreeStepsMatchCpu's f32 masters do (nvcc's fused multiply-adds: last bits), and on the GPU
// the high half is exactly the split of its own joined master (the weight the forward reads).
TEST(GpuMasterSplit, AdamWOnTheHalvesMatchesCpu) {
  MC_REQUIRE_CUDA();
  const int64_t n = 100003;
  const Tensor master = random_tensor({n}, DType::F32, Device::cpu(), -0.5, 0.5);
  Tensor m = random_tensor({n}, DType::F32, Device::cpu(), -0.1, 0.1), v = random_tensor({n}, DType::F32, Device::cpu(), 0.0, 0.01);
  std::vector<Tensor> grads;
  for (int i = 0; i < 3; ++i) grads.push_back(random_tensor({n}, DType::F32, Device::cpu(), -3.0, 3.0));
  // offset 1: views one element into their buffers (the kernel's one-element path, no packs).
  auto run = [&](Device d, int64_t offset) {
    auto view = [&](const Tensor& t) {
      Tensor buffer = Tensor::empty({n + 1}, t.dtype(), d);
      Tensor out = buffer.slice(0, offset, offset + n);
      out.copy_from(t.to(d));
      return out;
    };
    Tensor high = view(Tensor::empty({n}, DType::BF16)), remainder = view(Tensor::empty({n}, DType::I16));
    ops::split_master(master.to(d), high, remainder);
    Tensor md = view(m), vd = view(v);
    for (int64_t step = 1; step <= 3; ++step)
      ops::adamw_step_split(high, remainder, grads[step - 1].to(d), md, vd, {1e-3, 0.9, 0.95, 1e-8, 0.1, step},
                            step == 2 ? 0.5f : 1.0f);
    Tensor joined = Tensor::empty({n}, DType::F32, d);
    ops::join_master(high, remainder, joined);
    return std::vector<Tensor>{joined, high, md, vd};
  };
  const std::vector<Tensor> cpu = run(Device::cpu(), 0);
  for (int64_t offset : {0, 1}) {
    const std::vector<Tensor> gpu = run(kCuda, offset);
    EXPECT_TRUE(allclose(gpu[0], cpu[0], Tolerance{1e-6, 1e-5})) << "offset " << offset;
    EXPECT_TRUE(allclose(gpu[2], cpu[2], Tolerance{1e-6, 1e-5})) << "offset " << offset;
    EXPECT_TRUE(allclose(gpu[3], cpu[3], Tolerance{1e-6, 1e-5})) << "offset " << offset;
    Tensor high = Tensor::empty({n}, DType::BF16), remainder = Tensor::empty({n}, DType::I16);
    ops::split_master(gpu[0].to(Device::cpu()), high, remainder);
    EXPECT_EQ(to_doubles(gpu[1]), to_doubles(high)) << "offset " << offset;
    EXPECT_NE(to_doubles(gpu[0]), to_doubles(master));  // the steps moved the masters
  }
}
