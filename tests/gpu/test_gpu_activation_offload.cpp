// Fine-grained activation offloading on the GPU (bf16 compute, fp32 masters; pinned host memory,
// a side stream, events): every module offloaded, and expert_fc1 + moe_act with moe_act and
// core_attn recomputed, give the loss and every parameter gradient of keeping everything, bit
// for bit -- for one micro-batch and for two whose forwards and backwards interleave as in a
// pipeline schedule (forward 0, forward 1, backward 0, backward 1). Offloading makes the host
// wait no more often than keeping everything, and offloading every module lowers the device peak.
#include <gtest/gtest.h>

#include "moecore/core/allocator.h"
#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"
#include "moecore/ops/elementwise.h"

using namespace moecore;

namespace {

ModelConfig gpu_offload_model() {
  ModelConfig c;
  c.num_layers = 4;
  c.hidden_size = 64;
  c.num_attention_heads = 2;
  c.seq_length = 64;
  c.vocab_size = 97;
  c.add_bias_linear = false;
  c.untie_embeddings = true;
  c.moe.num_experts = 8;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 128;
  c.moe.shared_expert_size = 32;
  c.moe.aux_loss_coeff = 0.01;
  finalize_model_config(c, "[0,1,1,1]");
  return c;
}

struct Step {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;
  uint64_t host_waits = 0;
  int64_t peak = 0;
};

// micro_batches 1: forward + backward; 2: forward 0, forward 1, backward 0, backward 1.
Step gpu_step(const std::vector<std::string>& offload, bool recompute, int micro_batches) {
  ModelConfig c = gpu_offload_model();
  c.offload_modules = offload;
  if (recompute) {
    c.moe.recompute_act = true;
    c.recompute.core_attn = true;
  }
  ParamStore store(Device::cuda(0), DType::F32, DType::BF16, 77);  // fp32 masters, bf16 compute
  GPTModel model(c, store);
  store.initialize();
  const MockData data(c.vocab_size, c.seq_length, 5, "train");
  const size_t n = static_cast<size_t>(micro_batches);
  std::vector<Batch> batches;
  for (size_t m = 0; m < n; ++m) batches.push_back(data.batch(static_cast<int64_t>(m), 4, Device::cuda(0)));
  std::vector<GPTModel::Ctx> ctx(n);
  synchronize(Device::cuda(0));
  cuda_allocator(0).reset_peak();
  const uint64_t waits = host_synchronizations();
  std::vector<Tensor> sums;
  for (size_t m = 0; m < n; ++m)
    sums.push_back(model.forward_loss_sum(batches[m].tokens, batches[m].labels, true, 3 + m, ctx[m]));
  for (size_t m = 0; m < n; ++m) model.backward(1.0, ctx[m]);
  Step s;
  s.host_waits = host_synchronizations() - waits;
  synchronize(Device::cuda(0));
  s.peak = cuda_allocator(0).stats().peak_allocated_bytes;
  for (const Tensor& t : sums) s.losses.push_back(ops::cast_to(t.to(Device::cpu()), DType::F64).to_vector<double>()[0]);  // f64 is CPU-only
  for (const auto& p : store.all())
    if (p->trainable) s.grads.push_back(ops::cast_to(p->grad, DType::F32).to(Device::cpu()).to_vector<float>());
  return s;
}

void expect_same(const Step& a, const Step& b, const std::string& what) {
  EXPECT_EQ(a.losses, b.losses) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << what << ": parameter " << i;
  EXPECT_LE(b.host_waits, a.host_waits) << what << ": offloading made the host wait";
}

const std::vector<std::string> kEveryModule = {"attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"};

}  // namespace

TEST(GpuActivationOffload, OffloadingGivesThePlainGradientsBitForBit) {
  for (int micro_batches : {1, 2}) {
    const std::string n = std::to_string(micro_batches) + " micro-batch(es): ";
    const Step plain = gpu_step({}, false, micro_batches);
    expect_same(plain, gpu_step({}, false, micro_batches), n + "a second plain run (determinism of the kernels)");
    const Step every = gpu_step(kEveryModule, false, micro_batches);
    expect_same(plain, every, n + "every module offloaded");
    EXPECT_LT(every.peak, plain.peak) << n << "every module offloaded: the device peak";
    const Step recomputed = gpu_step({}, true, micro_batches);
    expect_same(recomputed, gpu_step({"expert_fc1", "moe_act", "core_attn"}, true, micro_batches),
                n + "expert_fc1 + moe_act + core_attn offloaded, moe_act and core_attn recomputed");
  }
}
