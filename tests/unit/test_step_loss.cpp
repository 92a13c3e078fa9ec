// The pieces that keep a training step's loss on the device: the host check of a micro-batch
// (check_batch_on_host), the model's forward with a host-checked batch (forward_loss_sum), the
// step's average (LossAccumulator) and the CPU side of core/host_transfer.h. Their GPU side (no
// waits) is tests/gpu/test_gpu_host_waits.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "moecore/core/error.h"
#include "moecore/core/host_transfer.h"
#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"
#include "moecore/train/loss_accumulator.h"

using namespace moecore;

namespace {

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

Tensor i32(std::vector<int32_t> v, Shape shape) { return Tensor::from_vector(v, shape); }

}  // namespace

TEST(CheckBatchOnHost, CountsLabelledTokensAndRefusesIdsOutsideTheVocabulary) {
  EXPECT_EQ(check_batch_on_host(i32({0, 1, 2, 3}, {2, 2}), i32({1, -1, 3, 2}, {2, 2}), 4), 3);
  EXPECT_EQ(check_batch_on_host(i32({0, 1}, {1, 2}), i32({-1, -100}, {1, 2}), 4), 0);
  EXPECT_NE(message_of([] { check_batch_on_host(i32({0, 4}, {1, 2}), i32({1, 1}, {1, 2}), 4); })
                .find("tokens[1] (sample 0, position 1) = 4 is out of range for the vocabulary of 4 (expected 0 <= token < 4"),
            std::string::npos);
  EXPECT_NE(message_of([] { check_batch_on_host(i32({0, -2}, {1, 2}), i32({1, 1}, {1, 2}), 4); })
                .find("tokens[1] (sample 0, position 1) = -2 is out of range"),
            std::string::npos);
  EXPECT_NE(message_of([] { check_batch_on_host(i32({0, 1}, {1, 2}), i32({1, 9}, {1, 2}), 4); })
                .find("labels[1] (sample 0, position 1) = 9 is out of range for the vocabulary of 4 (expected < 4, or negative to ignore"),
            std::string::npos);
  EXPECT_NE(message_of([] { check_batch_on_host(i32({0, 1, 2, 3, 0, 7}, {2, 3}), i32({1, 1, 1, 1, 1, 1}, {2, 3}), 4); })
                .find("tokens[5] (sample 1, position 2) = 7"),
            std::string::npos);
  EXPECT_NE(message_of([] { check_batch_on_host(i32({0, 1}, {1, 2}), i32({1, 1, 1}, {1, 3}), 4); })
                .find("must be [batch, seq] i32 on the host"),
            std::string::npos);
}

TEST(LossAccumulator, AveragesTheMicroBatchMeans) {
  LossAccumulator acc(3, Device::cpu(), DType::F32);
  acc.add(Tensor::from_vector(std::vector<float>{12.0f}, {1}), 4);   // mean 3
  acc.add(Tensor::from_vector(std::vector<float>{10.0f}, {1}), 2);   // mean 5
  acc.add(Tensor::from_vector(std::vector<float>{99.0f}, {1}), 0);   // no labels: mean 0
  acc.add(Tensor(), 5);                                              // a stage without the head
  EXPECT_NEAR(acc.value().to_vector<float>()[0], (3.0 + 5.0 + 0.0) / 3.0, 1e-6);
  EXPECT_NE(message_of([&] { acc.add(Tensor::from_vector(std::vector<double>{1.0}, {1}), 1); })
                .find("expected a one-element f32 tensor"),
            std::string::npos);
  EXPECT_NE(message_of([] { LossAccumulator(0, Device::cpu(), DType::F32); }).find("0 micro-batches; expected >= 1"),
            std::string::npos);
}

TEST(HostTransfer, CpuReadsAndUploadsAreCopies) {
  Tensor t = Tensor::from_vector(std::vector<float>{1.5f, -2.0f}, {2});
  PendingRead read;
  EXPECT_FALSE(read.started());
  read.start(t);
  t.data<float>()[0] = 7.0f;  // the read holds the values of start()
  EXPECT_EQ(read.get(), (std::vector<double>{1.5, -2.0}));
  EXPECT_FALSE(read.started());
  EXPECT_NE(message_of([&] { read.get(); }).find("PendingRead::get before start"), std::string::npos);
  read.start(t);
  t.data<float>()[1] = 8.0f;
  EXPECT_NE(message_of([&] { read.start(t); }).find("the previous read was not taken (get) yet"), std::string::npos);
  EXPECT_EQ(read.get(), (std::vector<double>{7.0, -2.0}));  // the refused start left the first read intact
  const Tensor bytes = Tensor::from_vector(std::vector<uint8_t>{1, 2}, {2});
  EXPECT_NE(message_of([&] { read.start(bytes); }).find("PendingRead::start: dtype u8 is not supported (expected f64, "
                                                          "f32, i64 or i32)"),
            std::string::npos);
  EXPECT_FALSE(read.started());
  PinnedUploader up;
  const Tensor host = Tensor::from_vector(std::vector<int32_t>{3, 4, 5}, {3});
  const Tensor copy = up.upload(host, Device::cpu());
  EXPECT_EQ(copy.to_vector<int32_t>(), (std::vector<int32_t>{3, 4, 5}));
  EXPECT_NE(copy.data_ptr(), host.data_ptr());
}

// A host-checked micro-batch gives the loss, the label count and the gradients of the forward
// that checks and counts on its own.
TEST(ForwardLossSum, HostCheckedBatchMatchesTheSelfCheckingForward) {
  ModelConfig c;
  c.num_layers = 1;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 32;
  c.seq_length = 8;
  c.vocab_size = 29;
  c.add_bias_linear = false;
  c.untie_embeddings = true;  // output_layer.weight's gradient comes from the loss alone
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 16;
  c.moe.aux_loss_coeff = 0.01;
  finalize_model_config(c, "1");
  const MockData data(c.vocab_size, c.seq_length, 3, "train");
  Batch b = data.batch(0, 2, Device::cpu());
  b.labels.data<int32_t>()[3] = -1;
  struct Result {
    double sum;
    int64_t labels;
    std::vector<float> grad, head_grad;
  };
  // given_labels < 0: the forward checks and counts itself; else ctx.checked_num_labels.
  auto run = [&](int64_t given_labels) {
    ParamStore store(Device::cpu(), DType::F32, DType::F32, 5);
    GPTModel model(c, store);
    store.initialize();
    GPTModel::Ctx ctx;
    ctx.fused_head_scale = 1.0;
    ctx.checked_num_labels = given_labels;
    const Tensor sum = model.forward_loss_sum(b.tokens, b.labels, true, 1, ctx);
    const int64_t labels = ctx.num_labels;  // backward releases the context
    model.backward(1.0, ctx);
    Result r{sum.to_vector<float>()[0], labels, {}, store.get("output_layer.weight").grad.to_vector<float>()};
    for (const auto& p : store.all())
      if (p->trainable)
        for (float g : p->grad.to_vector<float>()) r.grad.push_back(g);
    return r;
  };
  const int64_t counted = check_batch_on_host(b.tokens, b.labels, c.vocab_size);
  const Result self = run(-1), checked = run(counted);
  EXPECT_EQ(self.labels, 2 * c.seq_length - 1);
  EXPECT_EQ(counted, self.labels);
  EXPECT_EQ(checked.labels, self.labels);
  EXPECT_EQ(checked.sum, self.sum);
  EXPECT_EQ(checked.grad, self.grad);
  EXPECT_GT(self.sum / static_cast<double>(self.labels), 2.0);  // about ln(29)

  // The given count is the one used, not recounted: three times the count gives the same loss
  // sum and a third of the output layer's gradient (the mean's divisor).
  const Result tripled = run(3 * counted);
  EXPECT_EQ(tripled.labels, 3 * counted);
  EXPECT_EQ(tripled.sum, self.sum);
  ASSERT_EQ(tripled.head_grad.size(), self.head_grad.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < self.head_grad.size(); ++i) {
    worst = std::max(worst, std::fabs(3.0 * tripled.head_grad[i] - self.head_grad[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(self.head_grad[i])));
  }
  EXPECT_GT(scale, 0.0);
  EXPECT_LE(worst, 1e-5 * scale);  // f32 rounding of the scaled softmax gradient

  // The forward that checks its labels itself names a bad one's sample and position too.
  b.labels.data<int32_t>()[c.seq_length + 5] = 29;
  EXPECT_NE(message_of([&] { run(-1); })
                .find("labels[13] (sample 1, position 5) = 29 is out of range for the vocabulary of 29"),
            std::string::npos);
}
