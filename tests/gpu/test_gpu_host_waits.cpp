// What keeps the host from running ahead of the GPU in a training step: a micro-batch checked on
// the host (check_batch_on_host) and uploaded through pinned memory goes through the model's
// forward and backward without one wait; the loss stays on the device until a later read that
// has already arrived; FP8 training keeps its scaling state on the device (no wait either).
// host_synchronizations() counts every wait (core/device.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "moecore/core/host_transfer.h"
#include "moecore/data/mock_data.h"
#include "moecore/model/fp8_linear.h"
#include "moecore/model/gpt.h"
#include "moecore/train/metrics.h"
#include "moecore/train/train_setup.h"
#include "moecore/train/train_step.h"
#include "train_command.h"  // parse_train_args (apps/)
#include "gpu_busy.h"
#include "op_harness.h"

using namespace moecore;

namespace {

ModelConfig small_dense() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 2;  // head dim 32 (the CUDA attention supports 32, 64, 128)
  c.ffn_hidden_size = 128;
  c.seq_length = 48;
  c.vocab_size = 97;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.untie_embeddings = true;
  c.moe.num_experts = 0;
  c.position_embedding_type = "rope";  // learned positions upload their ids from pageable memory
  finalize_model_config(c, "1");
  return c;
}

// Keeps the GPU busy for 300 ms of GPU time, so that whatever the host does next is done before
// the queue drains unless it waits. (12 bf16 GEMMs of 8192^3 were used before: a fast card
// drained them early, and a read behind them once arrived before the host asked for it.)
void occupy_gpu(Device dev) { moecore::testing::hold_gpu(dev, 300.0); }

// The MoE variant of small_dense: 16 experts top-4 of hidden 256 (the Hopper grouped GEMM takes
// these shapes, so the layer runs on device-side expert offsets).
ModelConfig small_moe() {
  ModelConfig c = small_dense();
  c.hidden_size = 256;
  c.ffn_hidden_size = 512;
  c.num_attention_heads = 2;  // head dim 128
  c.moe.num_experts = 16;
  c.moe.router.topk = 4;
  c.moe.ffn_hidden_size = 128;
  c.moe.aux_loss_coeff = 1e-2;
  c.moe.z_loss_coeff = 1e-3;
  finalize_model_config(c, "1");
  return c;
}

// Uploads a host-checked micro-batch through pinned staging, runs the forward (loss sum on the
// device) and backward behind busy GPU work, and checks that the host never waited and that the
// loss read afterwards needs no wait either. The loss equals the self-checking forward's.
void expect_micro_batch_without_waits(const ModelConfig& cfg) {
  const Device dev = Device::cuda(0);
  ParamStore store(dev, DType::F32, DType::BF16, 11);
  GPTModel model(cfg, store);
  store.initialize();
  const MockData data(cfg.vocab_size, cfg.seq_length, 5, "train");
  Batch host = data.batch(0, 4, Device::cpu());
  host.labels.data<int32_t>()[7] = -1;  // an ignored token
  const int64_t labelled = check_batch_on_host(host.tokens, host.labels, cfg.vocab_size);
  EXPECT_EQ(labelled, 4 * cfg.seq_length - 1);

  // The reference: the forward that reads its labels and loss back (two waits at least).
  double reference = 0;
  {
    const Batch b{host.tokens.to(dev), host.labels.to(dev)};
    GPTModel::Ctx ctx;
    const uint64_t before = host_synchronizations();
    reference = model.forward(b.tokens, b.labels, false, 0, ctx);
    EXPECT_GE(host_synchronizations() - before, 2u) << "the unchecked forward reads its labels and its loss";
  }
  synchronize(dev);

  PinnedUploader uploader;
  PendingRead read;
  const uint64_t before = host_synchronizations();
  occupy_gpu(dev);
  const Batch b{uploader.upload(host.tokens, dev), uploader.upload(host.labels, dev), labelled};
  GPTModel::Ctx ctx;
  ctx.fused_head_scale = 1.0;
  ctx.checked_num_labels = b.num_labels;
  const Tensor sum = model.forward_loss_sum(b.tokens, b.labels, true, 3, ctx);
  model.backward(1.0, ctx);
  read.start(sum);
  EXPECT_EQ(host_synchronizations(), before) << "the checked micro-batch's upload, forward or backward waited";
  synchronize(dev);  // the step's one wait (the gradient norm's, in the trainer)
  const uint64_t after_wait = host_synchronizations();
  const double value = read.get()[0] / static_cast<double>(labelled);
  EXPECT_EQ(host_synchronizations(), after_wait) << "the loss read waited although its copy had arrived";
  // The same weights and batch; bf16 compute in another chunking of the output layer (fused with
  // its backward vs evaluation): equal to f32 rounding of the per-token sums. (The MoE layer's
  // training forward adds no loss term to the lm loss: its balancing losses are separate.)
  EXPECT_NEAR(value, reference, 1e-5 * std::fabs(reference));
  EXPECT_GT(value, 3.0) << "about ln(97) at initialisation";
}

}  // namespace

TEST(GpuHostWaits, CheckedMicroBatchRunsForwardAndBackwardWithoutWaiting) {
  MC_REQUIRE_CUDA();
  expect_micro_batch_without_waits(small_dense());
}

TEST(GpuHostWaits, CheckedMoeMicroBatchRunsForwardAndBackwardWithoutWaiting) {
  MC_REQUIRE_CUDA();
  const ModelConfig cfg = small_moe();
  {  // the layer takes device-side expert offsets only where the Hopper grouped GEMM takes its weights
    ParamStore probe(Device::cuda(0), DType::F32, DType::BF16, 11);
    GPTModel model(cfg, probe);
    for (const auto& p : probe.all())
      if ((p->name.find("experts.linear_fc1.weight") != std::string::npos ||
           p->name.find("experts.linear_fc2.weight") != std::string::npos) &&
          !ops::grouped_gemm_device_rows(p->weight))
        GTEST_SKIP() << "off Hopper the MoE layer copies its expert counts to the host (one wait per layer)";
  }
  expect_micro_batch_without_waits(cfg);
}

TEST(GpuHostWaits, PinnedUploadIsEnqueuedBehindBusyWork) {
  MC_REQUIRE_CUDA();
  const Device dev = Device::cuda(0);
  std::vector<int32_t> values(1 << 16);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<int32_t>(i * 2654435761u);
  const Tensor host = Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
  PinnedUploader uploader;
  // Three different arrays, each host tensor overwritten after its upload returns and a pinned
  // block of the same size taken and scribbled on in between: a staging buffer released before
  // its copy ran would be handed out again and the copy would deliver the scribble.
  Tensor up[3];
  std::vector<int32_t> expected[3];
  occupy_gpu(dev);
  Event busy(dev);
  busy.record();
  const uint64_t before = host_synchronizations();
  std::vector<Tensor> scribbles;
  for (int i = 0; i < 3; ++i) {
    Tensor h = host.clone();
    for (size_t j = 0; j < values.size(); ++j)
      h.data<int32_t>()[j] = static_cast<int32_t>(static_cast<uint32_t>(values[j]) + static_cast<uint32_t>(i));
    expected[i] = h.to_vector<int32_t>();
    up[i] = uploader.upload(h, dev);
    h.data<int32_t>()[0] = -1;  // the upload took its own copy
    Tensor scribble = Tensor::empty_pinned(host.shape(), DType::I32);
    std::memset(scribble.data_ptr(), 0x5a, values.size() * sizeof(int32_t));
    scribbles.push_back(scribble);
  }
  EXPECT_EQ(host_synchronizations(), before);
  EXPECT_FALSE(busy.ready()) << "the uploads returned only after the busy work had finished: they waited";
  for (int i = 0; i < 3; ++i) EXPECT_EQ(up[i].to_vector<int32_t>(), expected[i]) << "upload " << i;

  // For the record (not asserted: driver behaviour): whether a copy from pageable memory of the
  // same size waits for the queue.
  occupy_gpu(dev);
  Event busy2(dev);
  busy2.record();
  Tensor pageable = Tensor::empty(host.shape(), DType::I32, dev);
  pageable.copy_from(host);
  std::printf("[ info ] a 256 KiB pageable host->device copy behind busy work %s\n",
              busy2.ready() ? "waited for the queue" : "returned at once");
  EXPECT_EQ(pageable.to_vector<int32_t>(), values);
}

TEST(GpuHostWaits, PendingReadWaitsOnlyIfItsCopyHasNotArrived) {
  MC_REQUIRE_CUDA();
  const Device dev = Device::cuda(0);
  const Tensor t = Tensor::from_vector(std::vector<float>{1.5f, -2.0f}, {2}).to(dev);
  PendingRead read;
  occupy_gpu(dev);
  read.start(t);
  uint64_t before = host_synchronizations();
  EXPECT_EQ(read.get(), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(host_synchronizations() - before, 1u) << "a read behind busy work must wait, once";
  EXPECT_FALSE(read.started());
  read.start(t);
  synchronize(dev);
  before = host_synchronizations();
  EXPECT_EQ(read.get(), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(host_synchronizations(), before) << "the copy had arrived";
}

namespace {

// A one-GPU training run (dropless MoE, 16 experts top-4 of hidden 256 in bf16 so that the Hopper
// grouped GEMM takes device-side expert offsets; --clip-grad 1): after warm-up steps, the
// non-log steps (train_step and TrainMetrics::end_step) wait for the GPU zero times -- the
// gradient norm, the clipping and NaN/Inf decision, the MoE statistics and the expert bias stay
// on the device -- and the log step reads them back: finite losses, no skipped step.
void expect_sync_free_steps(const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {"--config", MOECORE_SOURCE_DIR "/configs/tiny.yaml", "--device", "cuda",
                                   "--bf16", "--hidden-size", "256", "--num-attention-heads", "2",
                                   "--ffn-hidden-size", "512", "--num-experts", "16", "--moe-router-topk", "4",
                                   "--moe-ffn-hidden-size", "128", "--clip-grad", "1.0", "--train-iters", "8",
                                   "--log-interval", "8", "--eval-interval", "0", "--lr-warmup-iters", "1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  bool help = false;
  std::string text;
  const TrainArgs args = parse_train_args(argv, &help, &text);
  TrainingRun run(args);
  for (const auto& p : run.store->all())
    if (p->name.find("experts.linear_fc1.weight") != std::string::npos && !ops::grouped_gemm_device_rows(p->weight))
      GTEST_SKIP() << "off Hopper the MoE layer copies its expert counts to the host (one wait per layer)";
  TrainMetrics metrics(args, /*logger=*/false);
  metrics.start_interval();
  for (int64_t it = 1; it <= 4; ++it) metrics.end_step(run, it, train_step(run, it), host_synchronizations());
  synchronize(run.dev);
  for (int64_t it = 5; it <= 7; ++it) {
    const uint64_t before = host_synchronizations();
    const bool logged = metrics.end_step(run, it, train_step(run, it), before);
    EXPECT_FALSE(logged);
    EXPECT_EQ(host_synchronizations() - before, 0u) << "non-log step " << it << " waited for the GPU";
  }
  EXPECT_TRUE(metrics.end_step(run, 8, train_step(run, 8), host_synchronizations()));  // reads them all
  EXPECT_EQ(run.state.skipped_iterations, 0);
  EXPECT_EQ(run.state.iteration, 8);
}

}  // namespace

TEST(GpuHostWaits, SteadyStateTrainingStepDoesNotWait) {
  MC_REQUIRE_CUDA();
  expect_sync_free_steps({});
}

TEST(GpuHostWaits, SteadyStateTrainingStepWithExpertBiasDoesNotWait) {
  MC_REQUIRE_CUDA();
  expect_sync_free_steps({"--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"});
}

// FP8 training (model/fp8_linear.h) keeps its amaxes, histories and scales on the device: a
// dense model's micro-batch runs forward and backward in FP8, and the delayed recipe's step-end
// update runs, without a host wait, per recipe.
TEST(GpuHostWaits, Fp8MicroBatchAndScalingUpdateRunWithoutWaiting) {
  MC_REQUIRE_CUDA();
  const Device dev = Device::cuda(0);
  for (const Fp8Config::Recipe recipe :
       {Fp8Config::Recipe::Tensorwise, Fp8Config::Recipe::Delayed, Fp8Config::Recipe::Blockwise}) {
    ModelConfig cfg = small_dense();
    cfg.fp8.enabled = true;
    cfg.fp8.hybrid = true;
    cfg.fp8.recipe = recipe;
    cfg.fp8.amax_history_len = 4;
    cfg.fp8.amax_compute_max = true;
    Fp8Context fp8(cfg.fp8);
    ParamStore store(dev, DType::F32, DType::BF16, 11);
    store.set_fp8(&fp8);
    GPTModel model(cfg, store);
    store.initialize();
    const MockData data(cfg.vocab_size, cfg.seq_length, 5, "train");
    const Batch host = data.batch(0, 4, Device::cpu());
    const int64_t labelled = check_batch_on_host(host.tokens, host.labels, cfg.vocab_size);
    PinnedUploader uploader;
    PendingRead read;
    synchronize(dev);
    const uint64_t before = host_synchronizations();
    occupy_gpu(dev);
    const Batch b{uploader.upload(host.tokens, dev), uploader.upload(host.labels, dev), labelled};
    GPTModel::Ctx ctx;
    ctx.fused_head_scale = 1.0;
    ctx.checked_num_labels = b.num_labels;
    fp8.set_recording(true);
    const Tensor sum = model.forward_loss_sum(b.tokens, b.labels, true, 3, ctx);
    model.backward(1.0, ctx);
    fp8.set_recording(false);
    fp8.finish_step(nullptr, nullptr);
    read.start(sum);
    EXPECT_EQ(host_synchronizations(), before) << "recipe " << static_cast<int>(recipe) << " waited on the host";
    synchronize(dev);
    const double loss = read.get()[0] / static_cast<double>(labelled);
    EXPECT_TRUE(std::isfinite(loss) && loss > 3.0) << "recipe " << static_cast<int>(recipe) << ": loss " << loss;
  }
}
