// A training step on the GPU in fp32 equals the CPU step: same initialisation (Philox), same
// batch, loss and every parameter gradient compared, over several MoE configurations. (That the
// tiny preset learns in bf16 on the GPU is the ctest train.gpu_bf16_tiny_halves_loss; with MTP
// train.gpu_bf16_tiny_mtp_halves_loss.)
#include <gtest/gtest.h>

#include <cmath>

#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"
#include "op_harness.h"

using namespace moecore;

namespace {

ModelConfig small_moe() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 2;  // head dim 32 (the CUDA attention supports 32, 64, 128)
  c.seq_length = 48;
  c.vocab_size = 97;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.untie_embeddings = true;
  c.moe.num_experts = 8;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 48;
  c.moe.aux_loss_coeff = 0.01;
  c.moe.z_loss_coeff = 0.001;
  return c;
}

struct StepResult {
  double loss;
  std::vector<double> mtp_losses;  // each MTP depth's mean loss (--mtp-num-layers)
  std::vector<std::pair<std::string, Tensor>> grads;  // on the CPU
};

StepResult one_step(ModelConfig cfg, Device dev, bool fused_head = false) {
  ParamStore store(dev, DType::F32, DType::F32, 77);
  GPTModel model(cfg, store);
  store.initialize();
  const MockData data(cfg.vocab_size, cfg.seq_length, 5, "train");
  const Batch b = data.batch(0, 4, dev);
  GPTModel::Ctx ctx;
  if (fused_head) ctx.fused_head_scale = 1.0;
  StepResult r;
  r.loss = model.forward(b.tokens, b.labels, true, 3, ctx);
  for (size_t k = 0; k < ctx.mtp_loss_sums.size(); ++k)
    r.mtp_losses.push_back(ctx.mtp_loss_sums[k].to_vector<float>()[0] / static_cast<double>(ctx.mtp_num_labels[k]));
  model.backward(1.0, ctx);
  for (const auto& p : store.all())
    if (p->trainable) r.grads.push_back({p->name, p->grad.to(Device::cpu())});
  return r;
}

double relative_error(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * double(x[i] - y[i]);
    den += double(y[i]) * y[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

void expect_gpu_step_matches_cpu(ModelConfig cfg, bool fused_head = false) {
  finalize_model_config(cfg, "1");
  const StepResult cpu = one_step(cfg, Device::cpu(), fused_head);
  const StepResult gpu = one_step(cfg, Device::cuda(0), fused_head);
  EXPECT_NEAR(gpu.loss, cpu.loss, 1e-4 * std::fabs(cpu.loss));
  ASSERT_EQ(gpu.mtp_losses.size(), static_cast<size_t>(cfg.mtp_num_layers));
  ASSERT_EQ(cpu.mtp_losses.size(), static_cast<size_t>(cfg.mtp_num_layers));
  for (size_t k = 0; k < cpu.mtp_losses.size(); ++k)
    EXPECT_NEAR(gpu.mtp_losses[k], cpu.mtp_losses[k], 1e-4 * std::fabs(cpu.mtp_losses[k])) << "mtp_" << k + 1;
  ASSERT_EQ(gpu.grads.size(), cpu.grads.size());
  for (size_t i = 0; i < cpu.grads.size(); ++i) {
    // fp32 sums in other orders: relative error ~1e-6; 1e-3 leaves room for a router decision
    // that flips on a near-tie, which would show as a much larger error in the experts it moves.
    EXPECT_LT(relative_error(gpu.grads[i].second, cpu.grads[i].second), 1e-3) << cpu.grads[i].first;
  }
}

}  // namespace

TEST(GpuTraining, Fp32StepMatchesCpuSoftmaxAuxZLoss) {
  MC_REQUIRE_CUDA();
  expect_gpu_step_matches_cpu(small_moe());
}

TEST(GpuTraining, Fp32StepMatchesCpuSigmoidGroupsBiasSeqAux) {
  MC_REQUIRE_CUDA();
  ModelConfig c = small_moe();
  c.moe.router.score = ops::RouterScore::Sigmoid;
  c.moe.router.num_groups = 4;
  c.moe.router.group_topk = 2;
  c.moe.enable_expert_bias = true;
  c.moe.load_balancing = LoadBalancing::SeqAuxLoss;
  c.qk_layernorm = true;
  expect_gpu_step_matches_cpu(c);
}

TEST(GpuTraining, Fp32StepMatchesCpuCapacityPaddingSharedGate) {
  MC_REQUIRE_CUDA();
  ModelConfig c = small_moe();
  c.moe.capacity_factor = 1.0;
  c.moe.pad_to_capacity = true;
  c.moe.shared_expert_size = 32;
  c.moe.shared_expert_gate = true;
  c.moe.router.pre_softmax = true;
  expect_gpu_step_matches_cpu(c);
}

// Multi-token prediction (model/mtp.h), two depths: each depth's loss and every gradient (the
// MTP modules' and the shared embedding's and output layer's), with the fused output layer and
// the plain one.
TEST(GpuTraining, Fp32StepMatchesCpuMtpTwoDepths) {
  MC_REQUIRE_CUDA();
  ModelConfig c = small_moe();
  c.mtp_num_layers = 2;
  c.mtp_loss_scaling_factor = 0.3;
  expect_gpu_step_matches_cpu(c, true);
  expect_gpu_step_matches_cpu(c, false);
}
