// gpu tier: the MoE path without host synchronisation. A routing plan made without its host copy
// (make_moe_routing copy_counts = false) equals the one made with it; its deferred checks raise
// the same errors; grouped GEMMs given only device offsets run the Hopper kernel without waiting
// for the GPU (the loop copies the counts first, same results); and a whole MoE layer forward +
// backward under the Hopper implementation makes no host synchronisation at all, with the
// outputs, gradients and statistics of the host-count path. host_synchronizations() counts every
// stream/event/device synchronisation and device -> pageable host copy (core/device.h).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/model/config.h"
#include "moecore/model/params.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/permute.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

const Device kGpu = Device::cuda(0);

// Valid expert ids, deliberately uneven (expert e gets ~ (e % 4 + 1) shares), one expert empty.
Tensor skewed_indices(int64_t tokens, int64_t k, int64_t experts, uint64_t salt) {
  std::vector<int32_t> v(static_cast<size_t>(tokens * k));
  uint64_t s = salt * 0x9E3779B97F4A7C15ull + 1;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    int32_t e = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(experts * 2)) / 2;
    if (e == 3) e = 4;  // expert 3 receives nothing
    x = e;
  }
  return Tensor::from_vector(v, {tokens, k}).to(kGpu);
}

std::vector<int32_t> ints(const Tensor& t) { return t.to_vector<int32_t>(); }

// The Hopper kernel must take these cases on a compute-capability 9.0 GPU (the default build
// has sm_90a code); elsewhere the tests check the fallback instead.
bool hopper_gpu() {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess && major == 9;
}

// Restores the process-wide grouped GEMM implementation when a test ends.
struct ImplGuard {
  ops::GroupedGemmImpl saved = ops::grouped_gemm_impl();
  ~ImplGuard() { ops::set_grouped_gemm_impl(saved); }
};

}  // namespace

TEST(DeviceRowsRouting, PlanWithoutHostCopyEqualsPlanWithIt) {
  const int64_t T = 300, k = 4, E = 16;
  const Tensor idx = skewed_indices(T, k, E, 1);
  for (bool padded : {false, true}) {
    SCOPED_TRACE(padded ? "padded" : "dropless");
    Tensor kept;
    int64_t pad = 0;
    if (padded) {
      pad = ops::expert_capacity(T, k, E, 1.0);
      kept = Tensor::empty({T, k}, DType::U8, kGpu);
      ops::capacity_mask(idx, random_tensor({T, k}, DType::F32, kGpu), E, pad, ops::DropPolicy::Probs, kept);
    }
    const ops::MoeRouting ref = ops::make_moe_routing(idx, kept, E, pad, true);
    synchronize(kGpu);
    const uint64_t before = host_synchronizations();
    const ops::MoeRouting r = ops::make_moe_routing(idx, kept, E, pad, false);
    EXPECT_EQ(host_synchronizations(), before) << "the plan without the host copy waited for the GPU";
    EXPECT_TRUE(r.host_tokens_per_expert.empty());
    EXPECT_EQ(r.num_rows, padded ? E * pad : T * k);
    EXPECT_EQ(ref.num_rows, r.num_rows);
    EXPECT_EQ(ints(r.row_map), ints(ref.row_map));
    EXPECT_EQ(ints(r.row_offsets), ints(ref.row_offsets));
    EXPECT_EQ(ints(r.kept_per_expert), ints(ref.kept_per_expert));
    EXPECT_EQ(ints(r.tokens_per_expert), ints(ref.tokens_per_expert));
    // The offsets are the prefix sums of the host counts of the plan that copied them.
    const std::vector<int32_t> off = ints(ref.row_offsets);
    ASSERT_EQ(off.size(), static_cast<size_t>(E + 1));
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(off[e + 1] - off[e], ref.host_tokens_per_expert[static_cast<size_t>(e)]);
    EXPECT_EQ(ints(r.kept_per_expert)[3], 0);
    EXPECT_NO_THROW(ops::check_moe_routing(r, idx));
    // The CPU plan of the same indices: the same layout and counts; accumulated counts agree.
    const ops::MoeRouting cpu =
        ops::make_moe_routing(idx.to(Device::cpu()), kept.defined() ? kept.to(Device::cpu()) : Tensor(), E, pad);
    EXPECT_EQ(ints(r.row_map), ints(cpu.row_map));
    EXPECT_EQ(ints(r.row_offsets), ints(cpu.row_offsets));
    Tensor acc = Tensor::zeros({E + 2}, DType::I64, kGpu), acc_cpu = Tensor::zeros({E + 2}, DType::I64);
    for (int i = 0; i < 2; ++i) ops::accumulate_routing_counts(r, acc), ops::accumulate_routing_counts(cpu, acc_cpu);
    EXPECT_EQ(acc.to_vector<int64_t>(), acc_cpu.to_vector<int64_t>());
  }
}

TEST(DeviceRowsRouting, DeferredChecksRaiseTheSameErrors) {
  const int64_t T = 40, k = 2, E = 8;
  std::vector<int32_t> v(static_cast<size_t>(T * k));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>(i % E);
  v[5 * k + 1] = static_cast<int32_t>(E);  // indices[5, 1] = 8: out of range
  const Tensor bad = Tensor::from_vector(v, {T, k}).to(kGpu);
  EXPECT_THROW(ops::make_moe_routing(bad, Tensor(), E, 0, true), Error);
  const ops::MoeRouting r = ops::make_moe_routing(bad, Tensor(), E, 0, false);  // nothing raised yet
  try {
    ops::check_moe_routing(r, bad);
    ADD_FAILURE() << "check_moe_routing accepted an out-of-range expert id";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("indices[5, 1] = 8 is out of range [0, 8)"), std::string::npos) << e.what();
  }
  Tensor acc = Tensor::zeros({E + 2}, DType::I64, kGpu);
  ops::accumulate_routing_counts(r, acc);
  EXPECT_EQ(acc.to_vector<int64_t>()[E], 1) << "the bad id must be flagged in the accumulated counts";
  EXPECT_EQ(acc.to_vector<int64_t>()[E + 1], 0);
  // Padded to a capacity some expert exceeds (no capacity_mask first).
  for (auto& x : v) x = 0;
  const Tensor crowded = Tensor::from_vector(v, {T, k}).to(kGpu);
  const ops::MoeRouting p = ops::make_moe_routing(crowded, Tensor(), E, 4, false);
  try {
    ops::check_moe_routing(p, crowded);
    ADD_FAILURE() << "check_moe_routing accepted an expert over capacity";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert 0 has 80 kept assignments, more than pad_to_capacity = 4"),
              std::string::npos)
        << e.what();
  }
  Tensor acc_p = Tensor::zeros({E + 2}, DType::I64, kGpu);
  ops::accumulate_routing_counts(p, acc_p);
  EXPECT_EQ(acc_p.to_vector<int64_t>()[E], 0);
  EXPECT_EQ(acc_p.to_vector<int64_t>()[E + 1], 1) << "the over-capacity expert must be flagged";
}

TEST(DeviceRowsGroupedGemm, KernelReadsDeviceOffsetsWithoutWaitingLoopCopiesThem) {
  ImplGuard guard;
  const int64_t E = 12, N = 192, K = 136;
  const std::vector<int64_t> counts = {70, 0, 129, 1, 300, 64, 0, 257, 33, 90, 8, 200};
  int64_t rows = 0;
  std::vector<int32_t> off = {0};
  for (int64_t c : counts) off.push_back(static_cast<int32_t>(rows += c));
  const ops::ExpertRows device_only{{}, Tensor::from_vector(off, {E + 1}).to(kGpu)};
  const Tensor x = random_tensor({rows, K}, DType::BF16, kGpu), w = random_tensor({E, N, K}, DType::BF16, kGpu);
  const Tensor dout = random_tensor({rows, N}, DType::BF16, kGpu);
  const bool kernel = ops::cuda::hopper_grouped_gemm_takes(w);
  for (ops::GroupedGemmImpl impl : {ops::GroupedGemmImpl::Hopper, ops::GroupedGemmImpl::Loop}) {
    ops::set_grouped_gemm_impl(impl);
    SCOPED_TRACE(ops::grouped_gemm_impl_name(impl));
    Tensor out_ref = Tensor::empty({rows, N}, DType::BF16, kGpu), out = Tensor::empty({rows, N}, DType::BF16, kGpu);
    Tensor dx_ref = Tensor::empty({rows, K}, DType::BF16, kGpu), dx = Tensor::empty({rows, K}, DType::BF16, kGpu);
    Tensor dw_ref = Tensor::zeros({E, N, K}, DType::F32, kGpu), dw = Tensor::zeros({E, N, K}, DType::F32, kGpu);
    ops::grouped_gemm_forward(x, w, counts, out_ref);
    ops::grouped_gemm_dgrad(dout, w, counts, dx_ref);
    ops::grouped_gemm_wgrad(dout, x, counts, dw_ref);
    synchronize(kGpu);
    const uint64_t before = host_synchronizations();
    ops::grouped_gemm_forward(x, w, device_only, out);
    ops::grouped_gemm_dgrad(dout, w, device_only, dx);
    ops::grouped_gemm_wgrad(dout, x, device_only, dw);
    const uint64_t waited = host_synchronizations() - before;
    const bool on_device = impl == ops::GroupedGemmImpl::Hopper && kernel;
    if (on_device) {
      EXPECT_EQ(waited, 0u) << "the kernel with device offsets waited for the GPU";
    } else {
      EXPECT_EQ(waited, 1u) << "the loop needs the counts on the host: copied once, reused by the three GEMMs";
    }
    EXPECT_EQ(ops::grouped_gemm_device_rows(w), on_device);
    // The same implementation on the same rows: identical bits.
    EXPECT_EQ(to_doubles(out), to_doubles(out_ref));
    EXPECT_EQ(to_doubles(dx), to_doubles(dx_ref));
    EXPECT_EQ(to_doubles(dw), to_doubles(dw_ref));
  }
  EXPECT_EQ(kernel, hopper_gpu()) << "the kernel takes this shape exactly on a Hopper GPU";
}

TEST(DeviceRowsGroupedGemm, AutoTakesTheKernelBelowFortyMillionElementsPerExpert) {
  ImplGuard guard;
  ops::set_grouped_gemm_impl(ops::GroupedGemmImpl::Auto);
  const Tensor small = Tensor::empty({4, 2048, 11264}, DType::BF16, kGpu);  // mixtral-small fc1: 23M
  const Tensor large = Tensor::empty({1, 4096, 14336}, DType::BF16, kGpu);  // Mixtral-8x7B: 58.7M
  EXPECT_EQ(ops::grouped_gemm_device_rows(small), hopper_gpu());
  EXPECT_FALSE(ops::grouped_gemm_device_rows(large));
  ops::set_grouped_gemm_impl(ops::GroupedGemmImpl::Mixed);  // the loop's wgrad needs host counts
  EXPECT_FALSE(ops::grouped_gemm_device_rows(small));
}

namespace {

// One MoE layer's forward + backward under Mixed (host counts) and Hopper (device offsets):
// the same outputs, input gradient and statistics, close weight gradients, and the host waits
// counted. capacity: --moe-expert-capacity-factor 1 with padding (the padded plan needs no
// counts; capacity_mask's index check still waits once).
void expect_layer_matches_host_path(bool capacity, uint64_t device_waits, uint64_t min_host_waits) {
  ImplGuard guard;
  ModelConfig c;
  c.num_layers = 1;
  c.hidden_size = 256;
  c.num_attention_heads = 2;
  c.seq_length = 128;
  c.vocab_size = 64;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.init_method_std = 0.05;
  c.moe.num_experts = 16;
  c.moe.router.topk = 4;
  c.moe.ffn_hidden_size = 128;
  c.moe.aux_loss_coeff = 1e-2;
  c.moe.z_loss_coeff = 1e-3;
  if (capacity) {
    c.moe.capacity_factor = 1.0;
    c.moe.pad_to_capacity = true;
  }
  finalize_model_config(c, "1");
  ParamStore store(kGpu, DType::F32, DType::BF16, 7);
  MoeLayer layer(store, "moe", c);
  store.initialize();
  const int64_t T = 512;
  const Tensor x = random_tensor({T, c.hidden_size}, DType::BF16, kGpu);
  const Tensor dy = random_tensor({T, c.hidden_size}, DType::BF16, kGpu);
  const std::vector<std::string> names = {"moe.experts.linear_fc1.weight", "moe.experts.linear_fc2.weight",
                                          "moe.router.weight"};

  struct Run {
    std::vector<double> out, dx, tokens_per_expert;
    std::vector<std::vector<double>> grads;
    uint64_t syncs = 0;
  };
  auto run = [&](ops::GroupedGemmImpl impl) {
    ops::set_grouped_gemm_impl(impl);
    store.zero_grad();
    Run r;
    for (int pass = 0; pass < 2; ++pass) {  // the second pass is measured (the first fills caches)
      store.zero_grad();
      layer.finish_step();
      synchronize(kGpu);
      const uint64_t before = host_synchronizations();
      MoeLayer::Ctx ctx;
      const Tensor out = layer.forward(x, 4, true, 11, ctx);
      const Tensor dx = layer.backward(dy, 1.0, ctx);
      r.syncs = host_synchronizations() - before;
      r.out = to_doubles(out);
      r.dx = to_doubles(dx);
    }
    for (const std::string& n : names) r.grads.push_back(to_doubles(store.get(n).grad));
    r.tokens_per_expert = layer.finish_step().tokens_per_expert;
    return r;
  };
  const Run host = run(ops::GroupedGemmImpl::Mixed);   // kernel forward/dgrad, cuBLAS wgrad: host counts
  const Run device = run(ops::GroupedGemmImpl::Hopper);
  const bool kernel = ops::grouped_gemm_device_rows(store.get(names[0]).weight) &&
                      ops::grouped_gemm_device_rows(store.get(names[1]).weight);
  EXPECT_GE(host.syncs, min_host_waits) << "the host-count path copies the plan's counts";
  if (kernel) {
    EXPECT_EQ(device.syncs, device_waits) << "host waits of the MoE layer with device-side expert offsets";
  }
  EXPECT_EQ(kernel, hopper_gpu()) << "the kernel takes this layer exactly on a Hopper GPU";
  // Forward and dgrad run the same kernel on the same rows in both: identical outputs and input
  // gradients; the weight gradients differ only in the wgrad's summation order (kernel vs cuBLAS).
  EXPECT_EQ(device.out, host.out);
  EXPECT_EQ(device.dx, host.dx);
  for (size_t i = 0; i < names.size(); ++i) {
    SCOPED_TRACE(names[i]);
    ASSERT_EQ(device.grads[i].size(), host.grads[i].size());
    double worst = 0, scale = 0;
    for (size_t j = 0; j < host.grads[i].size(); ++j) {
      worst = std::max(worst, std::fabs(device.grads[i][j] - host.grads[i][j]));
      scale = std::max(scale, std::fabs(host.grads[i][j]));
    }
    EXPECT_GT(scale, 0.0);
    EXPECT_LE(worst, 1e-4 * scale + 1e-6);  // fp32 accumulation in both; bf16 inputs identical
  }
  EXPECT_EQ(device.tokens_per_expert, host.tokens_per_expert);
  double total = 0;
  for (double t : device.tokens_per_expert) total += t;
  if (!capacity) EXPECT_EQ(total, static_cast<double>(T * c.moe.router.topk));
  if (capacity) EXPECT_LE(total, static_cast<double>(T * c.moe.router.topk));
}

}  // namespace

TEST(DeviceRowsMoeLayer, ForwardBackwardMakesNoHostSynchronisation) {
  expect_layer_matches_host_path(false, 0, 1);  // host path: the plan's one copy
}

TEST(DeviceRowsMoeLayer, PaddedCapacityWaitsOnlyForTheCapacityMaskCheck) {
  expect_layer_matches_host_path(true, 1, 2);  // host path: the mask's check and the plan's copy
}

namespace {

// A small SwiGLU MoE model config with both balancing losses (aux 1e-2, z 1e-3).
ModelConfig small_moe_config(int64_t layers, int64_t hidden, int64_t experts, int64_t topk) {
  ModelConfig c;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = hidden / 128;
  c.seq_length = 128;
  c.vocab_size = 64;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.moe.num_experts = experts;
  c.moe.router.topk = topk;
  c.moe.ffn_hidden_size = 128;
  c.moe.aux_loss_coeff = 1e-2;
  c.moe.z_loss_coeff = 1e-3;
  finalize_model_config(c, "1");
  return c;
}

}  // namespace

// The trainer's statistics read: prefetch_stats() on every layer, one wait, then the reads find
// the copies done. Two layers, the same inputs twice: read layer by layer (each layer waits for
// its counts and losses), then prefetched (one wait in all); the same statistics both ways.
TEST(DeviceRowsMoeLayer, PrefetchedStatisticsTakeOneWaitForAllLayers) {
  ImplGuard guard;
  ops::set_grouped_gemm_impl(ops::GroupedGemmImpl::Auto);
  const ModelConfig c = small_moe_config(2, 256, 8, 2);
  ParamStore store(kGpu, DType::F32, DType::BF16, 5);
  MoeLayer first(store, "moe0", c), second(store, "moe1", c);
  store.initialize();
  const Tensor x = random_tensor({256, c.hidden_size}, DType::BF16, kGpu);
  const Tensor dy = random_tensor({256, c.hidden_size}, DType::BF16, kGpu);
  auto step = [&] {
    for (MoeLayer* l : {&first, &second}) {
      MoeLayer::Ctx ctx;
      const Tensor out = l->forward(x, 2, true, 3, ctx);
      l->backward(dy, 1.0, ctx);
    }
    synchronize(kGpu);
  };
  step();
  uint64_t before = host_synchronizations();
  const MoeStepStats a0 = first.finish_step(), a1 = second.finish_step();
  EXPECT_GE(host_synchronizations() - before, 4u) << "read layer by layer: counts and losses of each";
  step();
  before = host_synchronizations();
  first.prefetch_stats();
  second.prefetch_stats();
  EXPECT_EQ(host_synchronizations(), before) << "prefetch_stats() waited";
  Event copied(kGpu);
  copied.record();
  copied.synchronize();
  const MoeStepStats b0 = first.finish_step(), b1 = second.finish_step();
  EXPECT_EQ(host_synchronizations() - before, 1u) << "the reads after the one wait waited again";
  EXPECT_EQ(b0.tokens_per_expert, a0.tokens_per_expert);
  EXPECT_EQ(b1.tokens_per_expert, a1.tokens_per_expert);
  // The loss sums may add in another order on the device (atomics): equal to float rounding.
  EXPECT_NEAR(b0.aux_loss, a0.aux_loss, 1e-6 * std::fabs(a0.aux_loss));
  EXPECT_NEAR(b1.z_loss, a1.z_loss, 1e-6 * std::fabs(a1.z_loss));
  EXPECT_GT(b0.aux_loss, 0.0);
  EXPECT_GT(b1.z_loss, 0.0);
  double total = 0;
  for (double t : b1.tokens_per_expert) total += t;
  EXPECT_EQ(total, 256.0 * 2);
  // Without a wait in between, the reads wait for the copies themselves (at most once a layer).
  step();
  first.prefetch_stats();
  const MoeStepStats c0 = first.finish_step();
  EXPECT_EQ(c0.tokens_per_expert, a0.tokens_per_expert);
  EXPECT_NEAR(c0.aux_loss, a0.aux_loss, 1e-6 * std::fabs(a0.aux_loss));
}

// The router's fp32 GEMMs as bf16 GEMMs of three-part operands (moe/router.cpp, bf16_parts)
// against the fp32 GEMMs (MOECORE_ROUTER_GEMM=fp32): the logits and the router weight's gradient
// agree to fp32 rounding (both accumulate exact products in fp32, in other orders), the same
// experts are chosen, and the input gradient (rounded to bf16) agrees to a bf16 step. A wrong
// part (the lo part left out, say) moves the logits by ~1e-5 relative: 5x the tolerance.
TEST(DeviceRowsMoeLayer, RouterBf16x3GemmsMatchFp32Gemms) {
  const ModelConfig c = small_moe_config(1, 512, 16, 4);
  ParamStore store(kGpu, DType::F32, DType::BF16, 9);
  MoeLayer layer(store, "moe", c);
  store.initialize();
  const Tensor x = random_tensor({384, c.hidden_size}, DType::BF16, kGpu);
  const Tensor dy = random_tensor({384, c.hidden_size}, DType::BF16, kGpu);
  struct Run {
    std::vector<double> logits, indices, dx, dw;
  };
  auto run = [&](const char* mode) {
    setenv("MOECORE_ROUTER_GEMM", mode, 1);
    store.zero_grad();
    MoeLayer::Ctx ctx;
    layer.forward(x, 3, true, 5, ctx);
    Run r{to_doubles(ctx.router.logits), to_doubles(ctx.router.indices), {}, {}};
    r.dx = to_doubles(layer.backward(dy, 1.0, ctx));
    r.dw = to_doubles(store.get("moe.router.weight").grad);
    layer.finish_step();
    unsetenv("MOECORE_ROUTER_GEMM");
    return r;
  };
  const Run fp32 = run("fp32"), split = run("bf16x3");
  auto max_abs = [](const std::vector<double>& v) {
    double m = 0;
    for (double a : v) m = std::max(m, std::fabs(a));
    return m;
  };
  auto worst = [](const std::vector<double>& a, const std::vector<double>& b) {
    double w = 0;
    for (size_t i = 0; i < a.size(); ++i) w = std::max(w, std::fabs(a[i] - b[i]));
    return w;
  };
  ASSERT_EQ(split.logits.size(), fp32.logits.size());
  EXPECT_LE(worst(split.logits, fp32.logits), 2e-6 * max_abs(fp32.logits));
  ASSERT_EQ(split.indices, fp32.indices) << "another expert chosen: the logits moved more than rounding";
  EXPECT_GT(max_abs(fp32.dw), 0.0);
  EXPECT_LE(worst(split.dw, fp32.dw), 2e-6 * max_abs(fp32.dw));
  // dx = expert path (identical) + router path (rounded to bf16 once in each run).
  EXPECT_LE(worst(split.dx, fp32.dx), 8e-3 * max_abs(fp32.dx));
  EXPECT_THROW({
    setenv("MOECORE_ROUTER_GEMM", "tf32", 1);
    MoeLayer::Ctx ctx;
    layer.forward(x, 3, true, 5, ctx);
  }, Error);
  unsetenv("MOECORE_ROUTER_GEMM");
}
