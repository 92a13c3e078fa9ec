#include "moecore/train/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace moecore {

double learning_rate(const TrainArgs& a, int64_t step) {
  const double max_lr = a.lr, min_lr = a.min_lr;
  if (a.lr_warmup_iters > 0 && step <= a.lr_warmup_iters)
    return max_lr * static_cast<double>(step) / static_cast<double>(a.lr_warmup_iters);
  if (a.lr_decay_style == LrDecayStyle::Constant) return max_lr;
  if (step > a.lr_decay_iters) return min_lr;
  const double span = static_cast<double>(std::max<int64_t>(1, a.lr_decay_iters - a.lr_warmup_iters));
  const double r = static_cast<double>(step - a.lr_warmup_iters) / span;
  switch (a.lr_decay_style) {
    case LrDecayStyle::Linear: return min_lr + (max_lr - min_lr) * (1.0 - r);
    case LrDecayStyle::Cosine: return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * r));
    case LrDecayStyle::WSD: {
      const int64_t decay_start = a.lr_decay_iters - a.lr_wsd_decay_iters;
      if (step <= decay_start) return max_lr;
      const double w = static_cast<double>(step - decay_start) / static_cast<double>(a.lr_wsd_decay_iters);
      double c = 1.0 - w;  // linear
      if (a.lr_wsd_decay_style == "cosine") c = 0.5 * (1.0 + std::cos(M_PI * w));
      if (a.lr_wsd_decay_style == "exponential") c = 2.0 * std::pow(0.5, w) - 1.0;
      if (a.lr_wsd_decay_style == "minus_sqrt") c = 1.0 - std::sqrt(w);
      return min_lr + (max_lr - min_lr) * c;
    }
    default: return max_lr;
  }
}

}  // namespace moecore
