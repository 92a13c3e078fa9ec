// The training-health test of a step (train/metrics.h step_health): all-zero gradients, and a
// loss that repeats the previous step's exactly with a gradient norm below 1e-8, are what
// TrainMetrics warns about; a learning step, a first step, a changed loss, a larger norm and a
// skipped (NaN/Inf) step are not.
#include <gtest/gtest.h>

#include "moecore/train/metrics.h"

using namespace moecore;

namespace {
StepResult step_of(double loss, double grad_norm, bool skipped = false) {
  StepResult s;
  s.lm_loss = loss;
  s.grad_norm = grad_norm;
  s.grad_sq = grad_norm * grad_norm;
  s.skipped = skipped;
  return s;
}
}  // namespace

TEST(StepHealth, ConstantLossWithVanishingGradNormIsReported) {
  // grad_sq > 0 but the norm below 1e-8, and the loss bit-identical to the previous step's
  EXPECT_EQ(step_health(step_of(4.852030, 3e-9), true, 4.852030), StepHealth::kConstantLoss);
  EXPECT_EQ(step_health(step_of(4.852030, 9.99e-9), true, 4.852030), StepHealth::kConstantLoss);
}

TEST(StepHealth, ZeroGradientsAreReportedEvenOnTheFirstStep) {
  EXPECT_EQ(step_health(step_of(4.85, 0.0), false, 0.0), StepHealth::kZeroGradients);
  EXPECT_EQ(step_health(step_of(4.85, 0.0), true, 4.85), StepHealth::kZeroGradients);
}

TEST(StepHealth, LearningStepsAreNot) {
  EXPECT_EQ(step_health(step_of(4.852030, 3e-9), false, 0.0), StepHealth::kLearning);  // no previous loss
  EXPECT_EQ(step_health(step_of(4.852031, 3e-9), true, 4.852030), StepHealth::kLearning);  // the loss moved
  EXPECT_EQ(step_health(step_of(4.852030, 2e-8), true, 4.852030), StepHealth::kLearning);  // the norm is not tiny
  EXPECT_EQ(step_health(step_of(3.1, 0.7), true, 3.2), StepHealth::kLearning);
  // a skipped step (NaN/Inf) is reported as such, not as a stalled one
  EXPECT_EQ(step_health(step_of(4.85, 0.0, true), true, 4.85), StepHealth::kLearning);
}
