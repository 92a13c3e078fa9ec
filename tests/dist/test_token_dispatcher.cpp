// dist tier: the expert-parallel token dispatchers (moe/token_dispatcher.h) over MPI.
//
// Every rank routes its own tokens to global experts; the "experts" scale each received row by
// (global expert id + 1), so every result has a closed form each rank computes locally:
//   out[t]      = sum_j kept(t,j) p(t,j) (e(t,j)+1) x[t]
//   dx[t]       = sum_j kept(t,j) p(t,j) (e(t,j)+1) dout[t]
//   dprobs[t,j] = kept(t,j) (e(t,j)+1) <dout[t], x[t]>
// Each case runs twice: the combine weighting by the probabilities (the one-call forms), and the
// experts applying them (probs_to_rows: a combine without probs; the phases one by one).
// Cases: random routing, every token of every rank on expert 0 (the other ranks receive
// nothing), capacity dropping, padding to capacity; both dispatchers; with and without expert
// tensor parallelism (ETP 2: ETP rank r's "experts" scale by (e+1)(r+1)/3 and combine sums them). dispatch_checks:: takes
// any communicator (test_comm_nccl.cpp runs it on device tensors through NCCL).
#include <gtest/gtest.h>

#include <cmath>

#include "moecore/comm/communicator.h"
#include "moecore/core/error.h"
#include "moecore/core/device.h"
#include "moecore/core/philox.h"
#include "moecore/moe/token_dispatcher.h"

using namespace moecore;

namespace dispatch_checks {

struct Routing {
  std::vector<int32_t> idx;
  std::vector<float> probs;
  std::vector<uint8_t> kept;  // empty: all kept
};

// pattern 0: random experts (distinct per token); 1: every assignment to expert 0 and 1.
Routing make_routing(int rank, int64_t tokens, int64_t k, int64_t experts, int pattern, bool drop) {
  Routing r;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const uint32_t w = philox_words(7, static_cast<uint64_t>(rank * 1000 + t), static_cast<uint64_t>(j)).w[0];
      const int64_t e = pattern == 1 ? j % experts : static_cast<int64_t>((w % experts + j * (experts / k)) % experts);
      r.idx.push_back(static_cast<int32_t>(e));
      r.probs.push_back(static_cast<float>(1 + w % 7) / 8.0f);
      if (drop) r.kept.push_back(static_cast<uint8_t>((w >> 8) % 3 != 0));
    }
  return r;
}

float x_value(int rank, int64_t t, int64_t h, uint64_t key) {
  const uint32_t w = philox_words(key, static_cast<uint64_t>(rank * 1000 + t), static_cast<uint64_t>(h)).w[0];
  return static_cast<float>(static_cast<int>(w % 65) - 32) / 32.0f;
}

// Scales each row of the expert input by (global expert + 1) * share on the host. With expert
// tensor parallelism ETP rank r's share is (r + 1) / (1 + 2 + ... + etp): the combine's sum is
// right only if every rank's partial arrives exactly once.
Tensor run_experts(const Tensor& in, const std::vector<int64_t>& groups, int64_t first_expert, int64_t etp = 1,
                   int64_t etp_rank = 0) {
  const float share = static_cast<float>(etp_rank + 1) / static_cast<float>(etp * (etp + 1) / 2);
  Tensor host = in.to(Device::cpu()).clone();  // a new tensor: on the CPU `to` would alias `in`
  float* p = host.data<float>();
  int64_t row = 0;
  for (size_t l = 0; l < groups.size(); ++l)
    for (int64_t i = 0; i < groups[l]; ++i, ++row)
      for (int64_t h = 0; h < in.size(1); ++h)
        p[row * in.size(1) + h] *= static_cast<float>(first_expert + l + 1) * share;
  return host.to(in.device());
}

// Row i of `in` times w[i] ([rows, 1] f32), on the host.
Tensor scale_rows(const Tensor& in, const Tensor& w) {
  Tensor host = in.to(Device::cpu()).clone();  // a new tensor: on the CPU `to` would alias `in`
  const std::vector<float> wv = w.to_vector<float>();
  float* p = host.data<float>();
  for (int64_t i = 0; i < in.size(0); ++i)
    for (int64_t h = 0; h < in.size(1); ++h) p[i * in.size(1) + h] *= wv[static_cast<size_t>(i)];
  return host.to(in.device());
}

// [rows, 1]: the dot product of each row of a with the same row of b.
Tensor row_dots(const Tensor& a, const Tensor& b) {
  const std::vector<float> av = a.to_vector<float>(), bv = b.to_vector<float>();
  const int64_t rows = a.size(0), h = a.size(1);
  std::vector<float> d(static_cast<size_t>(rows), 0.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < h; ++j) d[static_cast<size_t>(i)] += av[i * h + j] * bv[i * h + j];
  return Tensor::from_vector(d, {rows, 1}).to(a.device());
}

void expect_closed_form(int rank, int64_t tokens, int64_t k, int64_t hidden, const Routing& r, bool drop,
                        const std::vector<float>& xs, const std::vector<float>& douts, const Tensor& out,
                        const Tensor& dx, const Tensor& dprobs);

// c: the world (token values depend on its rank); ep / etp / tp_ep: the groups (ep = &c without ETP).
void check_dispatch(comm::Communicator& c, DispatcherType type, int pattern, bool drop, int64_t pad,
                    comm::Communicator* ep, comm::Communicator* etp = nullptr, comm::Communicator* tp_ep = nullptr) {
  const int rank = c.rank();
  const int64_t tokens = 6, k = 2, hidden = 5, experts = 2 * (ep ? ep->size() : 1);
  const int64_t etp_size = etp ? etp->size() : 1, etp_rank = etp ? etp->rank() : 0;
  const Device dev = c.device();
  const Routing r = make_routing(rank, tokens, k, experts, pattern, drop);
  std::vector<float> xs, douts;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      xs.push_back(x_value(rank, t, h, 11));
      douts.push_back(x_value(rank, t, h, 12));
    }
  const Tensor x = Tensor::from_vector(xs, {tokens, hidden}).to(dev);
  const Tensor dout = Tensor::from_vector(douts, {tokens, hidden}).to(dev);
  const Tensor idx = Tensor::from_vector(r.idx, {tokens, k}).to(dev);
  const Tensor probs = Tensor::from_vector(r.probs, {tokens, k}).to(dev);
  const Tensor kept = drop ? Tensor::from_vector(r.kept, {tokens, k}).to(dev) : Tensor();

  const auto dispatcher = make_token_dispatcher(type, experts, ep, etp, tp_ep);
  const TokenDispatcher& d = *dispatcher;
  DispatchInput in;
  in.x = x;
  in.probs = probs;
  in.indices = idx;
  in.kept = kept;
  in.pad = pad;
  TokenDispatcher::Ctx ctx;
  synchronize(dev);
  const uint64_t waits_before = host_synchronizations();
  const TokenRows dispatched = d.dispatch(in, ctx);
  const Tensor& expert_in = dispatched.rows;
  EXPECT_FALSE(dispatched.probs.defined()) << "probabilities for the combine reached the rows";
  if (dev.is_cuda() && type == DispatcherType::AllToAll && ep && !etp) {
    // One wait: the counts' all-gather read back (the sizes of the all-to-all). Capacity dropping
    // without padding adds the plan's own copy (its row count is the kept count).
    EXPECT_EQ(host_synchronizations() - waits_before, drop && pad == 0 ? 2u : 1u) << "host waits in alltoall dispatch";
  }
  int64_t rows = 0;
  for (int64_t g : ctx.local_rows.host) rows += g;
  EXPECT_EQ(rows, expert_in.size(0));
  const Tensor out = d.combine(run_experts(expert_in, ctx.local_rows.host, d.first_expert(), etp_size, etp_rank), ctx);
  const Tensor d_expert_out = d.combine_backward(dout, ctx);
  const TokenRows grads =
      d.dispatch_backward({run_experts(d_expert_out, ctx.local_rows.host, d.first_expert(), etp_size, etp_rank), Tensor()}, ctx);
  expect_closed_form(rank, tokens, k, hidden, r, drop, xs, douts, out, grads.rows, grads.probs);
  if (::testing::Test::HasFailure()) return;

  // The experts apply the probabilities (the weighted SwiGLU's way): the dispatch gives each
  // expert row its probability, the experts scale by it, the combine only sums; the row weights'
  // gradient <d_expert_out row, unweighted output row> goes back with the rows' gradient
  // (ETP partials summed). The closed forms are the same. This case runs the phases one by one,
  // as a scheduler would.
  SCOPED_TRACE("probabilities applied by the experts, phase by phase");
  in.probs_to_rows = true;
  TokenDispatcher::Ctx wctx;
  const TokenRows w = d.dispatch_postprocess(d.token_dispatch(d.dispatch_preprocess(in, wctx), wctx), wctx);
  ASSERT_TRUE(w.probs.defined());
  ASSERT_EQ(w.probs.size(0), w.rows.size(0));
  const Tensor unweighted = run_experts(w.rows, wctx.local_rows.host, d.first_expert(), etp_size, etp_rank);
  const Tensor w_out = d.combine_postprocess(
      d.token_combine(d.combine_preprocess(scale_rows(unweighted, w.probs), wctx), wctx), wctx);
  const Tensor w_d_expert_out = d.combine_preprocess_backward(
      d.token_combine_backward(d.combine_postprocess_backward(dout, wctx), wctx), wctx);
  EXPECT_FALSE(wctx.dprobs.defined()) << "a combine without probs has no probability gradient";
  const TokenRows w_d_in{
      scale_rows(run_experts(w_d_expert_out, wctx.local_rows.host, d.first_expert(), etp_size, etp_rank), w.probs),
      row_dots(w_d_expert_out, unweighted)};
  const TokenRows w_grads = d.dispatch_preprocess_backward(
      d.token_dispatch_backward(d.dispatch_postprocess_backward(w_d_in, wctx), wctx), wctx);
  expect_closed_form(rank, tokens, k, hidden, r, drop, xs, douts, w_out, w_grads.rows, w_grads.probs);
}

void expect_closed_form(int rank, int64_t tokens, int64_t k, int64_t hidden, const Routing& r, bool drop,
                        const std::vector<float>& xs, const std::vector<float>& douts, const Tensor& out,
                        const Tensor& dx, const Tensor& dprobs) {
  const std::vector<float> o = out.to_vector<float>(), g = dx.to_vector<float>(), dp = dprobs.to_vector<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    double dot = 0;
    for (int64_t h = 0; h < hidden; ++h) dot += static_cast<double>(xs[t * hidden + h]) * douts[t * hidden + h];
    double scale = 0;
    for (int64_t j = 0; j < k; ++j) {
      const size_t a = static_cast<size_t>(t * k + j);
      const bool on = !drop || r.kept[a];
      scale += on ? r.probs[a] * (r.idx[a] + 1.0) : 0.0;
      const double want = on ? (r.idx[a] + 1.0) * dot : 0.0;
      EXPECT_NEAR(dp[a], want, 1e-4 * (1 + std::fabs(want))) << "dprobs rank " << rank << " t " << t << " j " << j;
    }
    for (int64_t h = 0; h < hidden; ++h) {
      const size_t a = static_cast<size_t>(t * hidden + h);
      EXPECT_NEAR(o[a], scale * xs[a], 1e-5) << "out rank " << rank << " t " << t << " h " << h;
      EXPECT_NEAR(g[a], scale * douts[a], 1e-5) << "dx rank " << rank << " t " << t << " h " << h;
    }
  }
}

void check_cases(comm::Communicator& c, comm::Communicator* ep, comm::Communicator* etp, comm::Communicator* tp_ep) {
  for (DispatcherType type : {DispatcherType::AllToAll, DispatcherType::AllGather}) {
    SCOPED_TRACE(dispatcher_name(type));
    check_dispatch(c, type, 0, false, 0, ep, etp, tp_ep);
    check_dispatch(c, type, 1, false, 0, ep, etp, tp_ep);  // only rank 0's experts receive tokens
    check_dispatch(c, type, 0, true, 0, ep, etp, tp_ep);   // capacity dropping
    check_dispatch(c, type, 1, true, 12, ep, etp, tp_ep);  // padded: each (rank, expert) chunk has 12 rows
  }
}

// An expert id outside [0, E) on every rank (each rank then raises without a collective left
// half done): the alltoall dispatcher names the id, as make_moe_routing does. On CUDA the plan
// defers that check, and the id is missing from the all-gathered counts: the dispatcher must
// raise it instead of an all-to-all whose send counts do not add up.
void check_bad_expert_id(comm::Communicator& c) {
  const int64_t tokens = 6, k = 2, hidden = 5, experts = 2 * c.size();
  const Device dev = c.device();
  Routing r = make_routing(c.rank(), tokens, k, experts, 0, false);
  r.idx[5 * k + 1] = static_cast<int32_t>(experts);
  const Tensor x = Tensor::zeros({tokens, hidden}, DType::F32, dev);
  const Tensor idx = Tensor::from_vector(r.idx, {tokens, k}).to(dev);
  const auto d = make_token_dispatcher(DispatcherType::AllToAll, experts, &c);
  DispatchInput in;
  in.x = x;
  in.indices = idx;
  TokenDispatcher::Ctx ctx;
  try {
    d->dispatch(in, ctx);
    ADD_FAILURE() << "expert id " << experts << " of " << experts << " experts was dispatched";
  } catch (const Error& e) {
    const std::string want =
        "make_moe_routing: indices[5, 1] = " + std::to_string(experts) + " is out of range [0, " + std::to_string(experts) + ")";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

void check_all(comm::Communicator& c) {
  check_bad_expert_id(c);
  check_cases(c, &c, nullptr, nullptr);
  if (c.size() % 2 != 0) return;
  // Expert tensor parallelism, the expert generator's order (etp fastest): ETP groups {0,1},
  // {2,3}, ...; EP groups {0,2,...}, {1,3,...}; ETP x EP = the world.
  const int n = c.size(), r = c.rank();
  std::vector<int64_t> etp_ranks = {r - r % 2, r - r % 2 + 1}, ep_ranks;
  for (int i = r % 2; i < n; i += 2) ep_ranks.push_back(i);
  auto etp = c.split(etp_ranks);
  auto ep = c.split(ep_ranks);
  SCOPED_TRACE("ETP 2");
  check_cases(c, ep_ranks.size() > 1 ? ep.get() : nullptr, etp.get(), &c);
}

}  // namespace dispatch_checks

TEST(TokenDispatcherMpi, DispatchCombineAndBackwardsMatchTheClosedForm) {
  auto world = comm::make_mpi_world();
  dispatch_checks::check_all(*world);
}
