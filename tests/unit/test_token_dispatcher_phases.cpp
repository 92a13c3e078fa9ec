// The token dispatcher interface (moe/token_dispatcher.h) on one rank: the factory's dispatcher
// run phase by phase gives exactly what the one-call forms give, forward and backward, with the
// probabilities applied by the experts (rows get them) and by the combine; and dispatch then
// combine with identity experts is sum_j kept p x. The expert-parallel dispatchers are held to
// closed forms under MPI in tests/dist/test_token_dispatcher.cpp.
#include <gtest/gtest.h>

#include <vector>

#include "moecore/moe/token_dispatcher.h"

using namespace moecore;

namespace {

struct Case {
  DispatchInput in;
  Tensor dout;
};

// 6 tokens, top-2 of 4 experts, hidden 3; with capacity dropping (kept) and padding when asked.
Case make_case(bool drop, int64_t pad) {
  const int64_t t = 6, k = 2, h = 3;
  std::vector<float> x, dout, probs;
  std::vector<int32_t> idx = {0, 1, 2, 3, 1, 2, 3, 0, 0, 2, 1, 3};
  std::vector<uint8_t> kept = {1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1};
  for (int64_t i = 0; i < t * h; ++i) {
    x.push_back(static_cast<float>(i % 7) - 3.0f);
    dout.push_back(static_cast<float>(i % 5) * 0.5f - 1.0f);
  }
  for (int64_t i = 0; i < t * k; ++i) probs.push_back(0.125f * static_cast<float>(1 + i % 7));
  Case c;
  c.in.x = Tensor::from_vector(x, {t, h});
  c.in.probs = Tensor::from_vector(probs, {t, k});
  c.in.indices = Tensor::from_vector(idx, {t, k});
  if (drop) c.in.kept = Tensor::from_vector(kept, {t, k});
  c.in.pad = pad;
  c.dout = Tensor::from_vector(dout, {t, h});
  return c;
}

std::vector<float> values(const Tensor& t) { return t.defined() ? t.to_vector<float>() : std::vector<float>(); }

// The experts: row i times (i + 1), so every row's place matters.
Tensor experts(const Tensor& rows) {
  Tensor out = rows.clone();
  float* p = out.data<float>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    for (int64_t j = 0; j < rows.size(1); ++j) p[i * rows.size(1) + j] *= static_cast<float>(i + 1);
  return out;
}

struct Results {
  std::vector<float> rows, row_probs, out, d_expert_out, dx, dprobs;
};

Results run(const TokenDispatcher& d, const Case& c, bool phases) {
  TokenDispatcher::Ctx ctx;
  Results r;
  const TokenRows in = phases ? d.dispatch_postprocess(d.token_dispatch(d.dispatch_preprocess(c.in, ctx), ctx), ctx)
                              : d.dispatch(c.in, ctx);
  r.rows = values(in.rows);
  r.row_probs = values(in.probs);
  const Tensor y = experts(in.rows);
  const Tensor out =
      phases ? d.combine_postprocess(d.token_combine(d.combine_preprocess(y, ctx), ctx), ctx) : d.combine(y, ctx);
  r.out = values(out);
  const Tensor d_y = phases ? d.combine_preprocess_backward(
                                  d.token_combine_backward(d.combine_postprocess_backward(c.dout, ctx), ctx), ctx)
                            : d.combine_backward(c.dout, ctx);
  r.d_expert_out = values(d_y);
  TokenRows d_in{experts(d_y), Tensor()};
  if (in.probs.defined()) d_in.probs = in.probs.clone();  // any gradient for the row probabilities
  const TokenRows g = phases ? d.dispatch_preprocess_backward(
                                   d.token_dispatch_backward(d.dispatch_postprocess_backward(d_in, ctx), ctx), ctx)
                             : d.dispatch_backward(d_in, ctx);
  r.dx = values(g.rows);
  r.dprobs = values(g.probs);
  return r;
}

}  // namespace

TEST(TokenDispatcherPhases, PhaseByPhaseEqualsTheOneCallForms) {
  for (DispatcherType type : {DispatcherType::AllToAll, DispatcherType::AllGather})
    for (bool to_rows : {false, true})
      for (int variant = 0; variant < 3; ++variant) {
        SCOPED_TRACE(std::string(dispatcher_name(type)) + (to_rows ? " probs to rows" : " probs in the combine") +
                     " variant " + std::to_string(variant));
        Case c = make_case(variant > 0, variant == 2 ? 3 : 0);
        c.in.probs_to_rows = to_rows;
        const auto d = make_token_dispatcher(type, 4, nullptr);  // one rank: either type permutes locally
        EXPECT_EQ(d->local_experts(), 4);
        const Results one = run(*d, c, false), phased = run(*d, c, true);
        EXPECT_EQ(phased.rows, one.rows);
        EXPECT_EQ(phased.row_probs, one.row_probs);
        EXPECT_EQ(phased.out, one.out);
        EXPECT_EQ(phased.d_expert_out, one.d_expert_out);
        EXPECT_EQ(phased.dx, one.dx);
        EXPECT_EQ(phased.dprobs, one.dprobs);
        EXPECT_EQ(one.row_probs.empty(), !to_rows);
        EXPECT_FALSE(one.dprobs.empty()) << "the probabilities' gradient comes back either way";
      }
}

// Identity experts: out[t] = sum over kept j of p(t, j) x[t], whichever side applies p.
TEST(TokenDispatcherPhases, DispatchThenCombineWeightsEachTokenByItsKeptProbabilities) {
  for (bool to_rows : {false, true}) {
    Case c = make_case(true, 0);
    c.in.probs_to_rows = to_rows;
    const auto d = make_token_dispatcher(DispatcherType::AllToAll, 4, nullptr);
    TokenDispatcher::Ctx ctx;
    const TokenRows in = d->dispatch(c.in, ctx);
    Tensor y = in.rows.clone();
    if (to_rows) {
      float* p = y.data<float>();
      const std::vector<float> w = values(in.probs);
      for (int64_t i = 0; i < y.size(0); ++i)
        for (int64_t j = 0; j < y.size(1); ++j) p[i * y.size(1) + j] *= w[static_cast<size_t>(i)];
    }
    const std::vector<float> out = values(d->combine(y, ctx)), x = values(c.in.x), probs = values(c.in.probs);
    const std::vector<uint8_t> kept = c.in.kept.to_vector<uint8_t>();
    for (int64_t t = 0; t < 6; ++t) {
      float scale = 0;
      for (int64_t j = 0; j < 2; ++j)
        if (kept[static_cast<size_t>(t * 2 + j)]) scale += probs[static_cast<size_t>(t * 2 + j)];
      for (int64_t h = 0; h < 3; ++h)
        EXPECT_FLOAT_EQ(out[static_cast<size_t>(t * 3 + h)], scale * x[static_cast<size_t>(t * 3 + h)])
            << "to_rows " << to_rows << " t " << t << " h " << h;
    }
  }
}
