// The optimizer step decided on the device (ops::decide_adamw_step, train/step_decisions.h) against
// the host's decision it replaces (train_step before: the gradient norm read, clip = clip_grad /
// (norm + 1e-6) above the threshold, a NaN / Inf loss or norm skipping the step and not counting
// it for the learning rate and the AdamW step): the same parameters, moments and skip count, bit
// for bit, on CPU tensors (the same code as the CUDA kernels' element and decision functions),
// with steps resolved by the host only now and then (log steps), an Inf and a NaN gradient among
// them, and the clip coefficient below and above the threshold.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "moecore/ops/adamw.h"
#include "moecore/ops/adamw_host.h"
#include "moecore/ops/master_split.h"
#include "moecore/ops/reduce.h"
#include "moecore/train/lr_schedule.h"
#include "moecore/train/step_decisions.h"

using namespace moecore;

namespace {

constexpr int64_t kN = 37;

TrainArgs schedule() {
  TrainArgs a;
  a.lr = 3e-3;
  a.min_lr = 1e-4;
  a.lr_warmup_iters = 2;
  a.train_iters = 12;
  a.lr_decay_style = LrDecayStyle::Cosine;
  a.weight_decay = 0.1;
  a.clip_grad = 1.0;
  return a;
}

// Step it's gradient: mostly small (norm below 1) or large (above), with an Inf at step 3 and a
// NaN at step 5; step 7 has a NaN loss.
Tensor gradient(int64_t it) {
  std::vector<float> g(kN);
  const float size = it % 2 == 0 ? 0.05f : 0.9f;
  for (int64_t i = 0; i < kN; ++i) g[static_cast<size_t>(i)] = size * std::sin(0.7f * static_cast<float>(i * it + 1));
  if (it == 3) g[4] = std::numeric_limits<float>::infinity();
  if (it == 5) g[9] = std::numeric_limits<float>::quiet_NaN();
  return Tensor::from_vector(g, {kN});
}
double loss_of(int64_t it) { return it == 7 ? std::numeric_limits<double>::quiet_NaN() : 4.0 / static_cast<double>(it); }

Tensor squares(const Tensor& g) {  // the optimizer's device part: f32 [1]
  Tensor out = Tensor::empty({1}, DType::F32, Device::cpu());
  ops::sum_squares(g, out);
  return out;
}

struct Masters {
  Tensor p, m, v;
  Masters() {
    std::vector<float> p0(kN);
    for (int64_t i = 0; i < kN; ++i) p0[static_cast<size_t>(i)] = 0.3f * std::cos(static_cast<float>(i));
    p = Tensor::from_vector(p0, {kN});
    m = Tensor::zeros({kN}, DType::F32, Device::cpu());
    v = Tensor::zeros({kN}, DType::F32, Device::cpu());
  }
};

void expect_bits(const Tensor& a, const Tensor& b, const char* what) {
  ASSERT_EQ(a.nbytes(), b.nbytes());
  EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0) << what << " differs";
}

// How to apply one step: plain f32 AdamW, or the split-master halves (high, remainder).
enum class Kind { kPlain, kSplit, kHost };

void apply_host(Masters& s, const Tensor& g, const ops::AdamWConfig& c, float clip, Kind kind) {
  if (kind == Kind::kPlain) {
    ops::adamw_step(s.p, g, s.m, s.v, c, clip);
  } else if (kind == Kind::kHost) {
    std::vector<ops::HostAdamWPiece> pieces = {{s.p, g, s.m, s.v, Tensor(), c}};
    ops::adamw_step_host(pieces, clip, 3);
  } else {
    Tensor high = Tensor::empty({kN}, DType::BF16, Device::cpu()), rem = Tensor::empty({kN}, DType::I16, Device::cpu());
    ops::split_master(s.p, high, rem);
    ops::adamw_step_split(high, rem, g, s.m, s.v, c, clip);
    ops::join_master(high, rem, s.p);
  }
}

void apply_device(Masters& s, const Tensor& g, const Tensor& step, Kind kind) {
  if (kind == Kind::kPlain) {
    ops::adamw_step(s.p, g, s.m, s.v, step, true);
  } else if (kind == Kind::kHost) {
    ops::AdamWConfig c{0.0, 0.9, 0.95, 1e-8, 0.1, 1};  // only weight_decay > 0 counts
    std::vector<ops::HostAdamWPiece> pieces = {{s.p, g, s.m, s.v, Tensor(), c}};
    ops::adamw_step_host(pieces, step, 3);
  } else {
    Tensor high = Tensor::empty({kN}, DType::BF16, Device::cpu()), rem = Tensor::empty({kN}, DType::I16, Device::cpu());
    ops::split_master(s.p, high, rem);
    ops::adamw_step_split(high, rem, g, s.m, s.v, step, true);
    ops::join_master(high, rem, s.p);
  }
}

// Twelve steps both ways; the device's steps are resolved at the "log steps" 4, 9 and 12 only.
// fixed_rows > 0: the other steps decide as a CUDA graph's do (train/train_graph.h: prepare into the
// fixed table of that many rows, then decide_on_device), the log steps as eager ones.
void expect_same_run(Kind kind, int64_t fixed_rows = 0) {
  TrainArgs args = schedule();
  args.adam_beta2 = 0.95;
  Masters host, device;
  int64_t host_skipped = 0;
  StepDecisions decisions;
  TrainingState state;
  std::vector<std::vector<double>> reports;  // each unresolved step's {loss, grad_sq, skip}
  int64_t device_skips = 0;
  for (int64_t it = 1; it <= args.train_iters; ++it) {
    const Tensor g = gradient(it), parts = squares(g);
    // The host's decision as train_step made it.
    const double grad_sq = static_cast<double>(parts.data<float>()[0]), loss = loss_of(it);
    const double lr = learning_rate(args, it - 1 - host_skipped);
    if (!std::isfinite(loss) || !std::isfinite(grad_sq)) {
      host_skipped++;
    } else {
      const double norm = std::sqrt(grad_sq);
      const double clip = args.clip_grad > 0 && norm > args.clip_grad ? args.clip_grad / (norm + 1e-6) : 1.0;
      const ops::AdamWConfig c{lr, args.adam_beta1, args.adam_beta2, args.adam_eps, args.weight_decay, it - host_skipped};
      apply_host(host, g, c, static_cast<float>(clip), kind);
    }
    // On the device (here: CPU tensors), resolved at the log steps only.
    const Tensor loss_t = Tensor::from_vector(std::vector<float>{static_cast<float>(loss)}, {1});
    const bool log_step = it == 4 || it == 9 || it == 12;
    if (fixed_rows > 0 && !log_step) {
      decisions.prepare(args, state, it, Device::cpu(), fixed_rows);
      decisions.decide_on_device(args, parts, loss_t);
    } else {
      decisions.decide(args, state, it, parts, loss_t, Device::cpu());
    }
    apply_device(device, g, decisions.device_step(), kind);
    reports.push_back(decisions.report().to_vector<double>());
    EXPECT_EQ(std::memcmp(&reports.back()[1], &grad_sq, sizeof(double)), 0) << "the reported grad_sq, iteration " << it;
    if (log_step) {
      for (const std::vector<double>& r : reports) state.skipped_iterations += r[2] != 0.0 ? 1 : 0;
      reports.clear();
      decisions.resolved();
      EXPECT_EQ(state.skipped_iterations, host_skipped) << "iteration " << it;
    }
    device_skips = state.skipped_iterations;
  }
  EXPECT_EQ(device_skips, 3) << "the Inf and NaN gradients and the NaN loss";
  expect_bits(device.p, host.p, "the parameters");
  expect_bits(device.m, host.m, "exp_avg");
  expect_bits(device.v, host.v, "exp_avg_sq");
}

ops::AdamWDeviceStep decided(double grad_sq, double loss, double clip_grad, std::vector<double>* report = nullptr) {
  Tensor step = ops::make_adamw_device_step(Device::cpu());
  Tensor skips = Tensor::zeros({1}, DType::F64, Device::cpu()), rep = Tensor::zeros({3}, DType::F64, Device::cpu());
  const ops::AdamWDecision d{0.9, 0.999, 1e-8, clip_grad};
  std::vector<double> row(4);
  ops::adamw_candidate(1e-3, 1, d, 0.01, row.data());
  const Tensor candidates = Tensor::from_vector(row, {1, 4});
  ops::decide_adamw_step(Tensor::from_vector(std::vector<double>{grad_sq}, {1}),
                         Tensor::from_vector(std::vector<double>{loss}, {1}), candidates, d, skips, step, rep);
  if (report) *report = rep.to_vector<double>();
  ops::AdamWDeviceStep out;
  std::memcpy(&out, step.data_ptr(), sizeof(out));
  return out;
}

}  // namespace

TEST(StepDecisions, PlainAdamWMatchesTheHostDecisionBitForBit) { expect_same_run(Kind::kPlain); }
TEST(StepDecisions, SplitMastersMatchTheHostDecisionBitForBit) { expect_same_run(Kind::kSplit); }
TEST(StepDecisions, HostOffloadAdamWMatchesTheHostDecisionBitForBit) { expect_same_run(Kind::kHost); }
// The CUDA graph's way (a fixed candidate table of more rows than unresolved steps) between eager
// log steps: the same run.
TEST(StepDecisions, FixedCandidateTableMatchesTheHostDecisionBitForBit) {
  expect_same_run(Kind::kPlain, 6);
  expect_same_run(Kind::kSplit, 11);
}

TEST(StepDecisions, ClipCoefficientBelowAndAboveTheThreshold) {
  const ops::AdamWDeviceStep below = decided(0.25, 2.0, 1.0);  // norm 0.5
  EXPECT_EQ(below.skip, 0);
  EXPECT_EQ(below.k32[1].grad_scale, 1.0f);
  EXPECT_EQ(below.k64[1].grad_scale, 1.0);
  const ops::AdamWDeviceStep above = decided(9.0, 2.0, 1.0);  // norm 3
  EXPECT_EQ(above.k32[0].grad_scale, static_cast<float>(1.0 / (3.0 + 1e-6)));
  EXPECT_EQ(above.k64[1].grad_scale, static_cast<double>(static_cast<float>(1.0 / (3.0 + 1e-6))));
  const ops::AdamWDeviceStep off = decided(9.0, 2.0, 0.0);  // --clip-grad 0: no clipping
  EXPECT_EQ(off.k32[1].grad_scale, 1.0f);
  // The coefficients are adamw_coefficients' on the host.
  const ops::AdamWCoefficients<float> k = ops::adamw_coefficients<float>({1e-3, 0.9, 0.999, 1e-8, 0.01, 1}, 1.0f);
  EXPECT_EQ(std::memcmp(&below.k32[1], &k, sizeof(k)), 0);
}

TEST(StepDecisions, InfAndNanSkipTheStepAndReportIt) {
  std::vector<double> report;
  EXPECT_EQ(decided(std::numeric_limits<double>::infinity(), 2.0, 1.0, &report).skip, 1);
  EXPECT_EQ(report[2], 1.0);
  EXPECT_EQ(decided(std::numeric_limits<double>::quiet_NaN(), 2.0, 1.0).skip, 1);
  EXPECT_EQ(decided(1.0, std::numeric_limits<double>::infinity(), 1.0, &report).skip, 1);
  EXPECT_EQ(report[0], std::numeric_limits<double>::infinity());
  EXPECT_EQ(decided(1.0, 2.0, 1.0, &report).skip, 0);
  EXPECT_EQ(report, (std::vector<double>{2.0, 1.0, 0.0}));
}

TEST(StepDecisions, BadArgumentsAreRefused) {
  Tensor step = ops::make_adamw_device_step(Device::cpu());
  Tensor skips = Tensor::zeros({1}, DType::F64, Device::cpu()), rep = Tensor::zeros({3}, DType::F64, Device::cpu());
  const ops::AdamWDecision d{0.9, 0.999, 1e-8, 1.0};
  const Tensor parts = Tensor::zeros({1}, DType::F32, Device::cpu());
  const Tensor no_rows = Tensor::zeros({0, 4}, DType::F64, Device::cpu());
  EXPECT_THROW(ops::decide_adamw_step(parts, Tensor(), no_rows, d, skips, step, rep), Error);
  Tensor small = Tensor::zeros({8}, DType::U8, Device::cpu());
  const Tensor row = Tensor::zeros({1, 4}, DType::F64, Device::cpu());
  EXPECT_THROW(ops::decide_adamw_step(parts, Tensor(), row, d, skips, small, rep), Error);
  std::vector<double> r(4);
  EXPECT_THROW(ops::adamw_candidate(-1.0, 1, d, 0.0, r.data()), Error);
}
