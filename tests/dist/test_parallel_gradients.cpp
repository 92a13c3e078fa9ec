// dist tier: every tensor/sequence/context/expert-parallel layout of a small MoE GPT gives the
// single-rank model's loss, balancing losses and parameter gradients (Megatron's aux-loss test:
// router and every other gradient under (TP, EP, CP) layouts, both dispatchers).
//
// f64 on the CPU, so the comparison is tight (1e-9 of each tensor's largest gradient). Every
// data-parallel replica trains on the same batch, so the reduced gradients (dense averaged over
// DP, experts summed over EDP and scaled 1/DP) equal the single-rank gradients of that batch.
// The reduction is the trainer's (Optimizer::reduce_gradients: TP sums of sequence-parallel
// parameters, DP x CP sums); the full tensors come from Optimizer::full_state's gathers (TP and
// ETP parts, EP rows), applied to the gradients copied into the masters.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "moecore/comm/communicator.h"
#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"
#include "moecore/parallel/rank_generator.h"
#include "moecore/train/optimizer.h"

using namespace moecore;

namespace {

ModelConfig config() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.ffn_hidden_size = 24;
  c.num_attention_heads = 4;
  c.num_query_groups = 4;
  c.seq_length = 16;
  c.vocab_size = 32;
  c.add_bias_linear = false;
  c.qk_layernorm = true;
  c.init_method_std = 0.3;  // visible gradients everywhere
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 12;
  c.moe.aux_loss_coeff = 0.1;
  c.moe.z_loss_coeff = 0.01;
  c.moe.shared_expert_size = 8;
  c.moe.shared_expert_gate = true;
  finalize_model_config(c, "[0,1]");  // a dense layer, then an MoE layer
  return c;
}

struct Result {
  double loss = 0, aux = 0, z = 0;
  std::map<std::string, std::vector<double>> grads;
};

Result single_rank(const ModelConfig& cfg, const Batch& b) {
  ParamStore store(Device::cpu(), DType::F64, DType::F64, 11);
  GPTModel model(cfg, store);
  store.initialize();
  GPTModel::Ctx ctx;
  Result r;
  r.loss = model.forward(b.tokens, b.labels, true, 5, ctx);
  model.backward(1.0, ctx);
  for (MoeLayer* l : model.moe_layers()) {
    r.aux += l->stats().aux_loss;
    r.z += l->stats().z_loss;
  }
  for (const auto& p : store.all())
    if (p->trainable) r.grads[p->name] = p->grad.to_vector<double>();
  return r;
}

struct Layout {
  int64_t tp, cp, ep;
  DispatcherType dispatcher;
};

Result parallel_run(comm::Communicator& world, const ModelConfig& cfg, const Batch& b, const Layout& l) {
  parallel::ParallelConfig pc;
  pc.world = world.size();
  pc.tp = l.tp;
  pc.cp = l.cp;
  pc.ep = l.ep;
  const parallel::ProcessGroupLayout g = parallel::layout_for_rank(pc, world.rank());
  std::vector<std::unique_ptr<comm::Communicator>> owned;
  auto group = [&](const std::vector<int64_t>& ranks) -> comm::Communicator* {
    if (ranks.size() <= 1) return nullptr;
    owned.push_back(world.split(ranks));
    return owned.back().get();
  };
  DenseParallel dense;
  dense.tp = group(g.tp);
  dense.cp = group(g.cp);
  dense.sequence_parallel = true;
  MoeParallel moe;
  moe.ep = group(g.ep);
  moe.token_group = group(g.tp_cp);
  moe.dispatcher = l.dispatcher;
  OptimizerGroups og;
  og.dp = group(g.dp_cp);
  og.tp = dense.tp;
  og.ep = moe.ep;
  og.edp = group(g.expt_dp);
  og.dp_size = world.size() / (l.tp * l.cp);
  moe.aux_group = group(g.dp);

  ParamStore store(Device::cpu(), DType::F64, DType::F64, 11);
  GPTModel model(cfg, store, moe, PipelineStage{}, dense);
  store.initialize();
  Optimizer opt(store, og, false);
  GPTModel::Ctx ctx;
  Result r;
  const Tensor tokens = context_parallel_slice(b.tokens, l.cp, g.cp_rank);
  const Tensor labels = context_parallel_slice(b.labels, l.cp, g.cp_rank);
  r.loss = model.forward(tokens, labels, true, 5, ctx);
  model.backward(1.0, ctx);
  opt.reduce_gradients();
  for (MoeLayer* layer : model.moe_layers()) {
    std::vector<double> shares = {layer->stats().aux_loss, layer->stats().z_loss};
    if (moe.token_group) comm::all_reduce_host(*moe.token_group, shares);  // each rank holds its tokens' share
    r.aux += shares[0];
    r.z += shares[1];
  }
  for (const auto& p : store.all())
    if (p->trainable) p->master.copy_from(p->grad);  // so that full_state gathers the gradients
  for (const NamedTensor& t : opt.full_state())
    if (t.name.find(".exp_avg") == std::string::npos) r.grads[t.name] = t.tensor.to_vector<double>();
  return r;
}

void expect_same(const Result& want, const Result& got, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_NEAR(got.loss, want.loss, 1e-10 * std::abs(want.loss));
  EXPECT_NEAR(got.aux, want.aux, 1e-10 * std::abs(want.aux));
  EXPECT_NEAR(got.z, want.z, 1e-10 * std::abs(want.z));
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (const auto& [name, w] : want.grads) {
    const auto it = got.grads.find(name);
    ASSERT_NE(it, got.grads.end()) << name;
    ASSERT_EQ(it->second.size(), w.size()) << name;
    double scale = 0, worst = 0;
    for (double v : w) scale = std::max(scale, std::abs(v));
    for (size_t i = 0; i < w.size(); ++i) worst = std::max(worst, std::abs(it->second[i] - w[i]));
    EXPECT_GT(scale, 0.0) << name << " has no gradient";
    EXPECT_LE(worst, 1e-9 * scale) << name << " (largest gradient " << scale << ")";
  }
}

}  // namespace

TEST(ParallelGradients, TensorSequenceContextExpertLayoutsEqualOneRank) {
  auto world = comm::make_mpi_world();
  const ModelConfig cfg = config();
  const MockData data(cfg.vocab_size, cfg.seq_length, 3, "train");
  const Batch b = data.batch(0, 2, Device::cpu());  // two sequences: the sequence gathers reorder
  const Result want = single_rank(cfg, b);
  // (TP, CP, EP): Megatron's aux-loss test layouts that fit this world.
  std::vector<Layout> layouts;
  if (world->size() == 2) layouts = {{2, 1, 1, {}}, {1, 2, 1, {}}, {2, 1, 2, {}}, {1, 2, 2, {}}};
  if (world->size() == 4) layouts = {{4, 1, 2, {}}, {1, 4, 1, {}}, {2, 2, 1, {}}, {2, 1, 2, {}}, {2, 2, 4, {}}};
  ASSERT_FALSE(layouts.empty()) << "run with 2 or 4 ranks";
  for (const Layout& base : layouts)
    for (DispatcherType d : {DispatcherType::AllToAll, DispatcherType::AllGather}) {
      Layout l = base;
      l.dispatcher = d;
      expect_same(want, parallel_run(*world, cfg, b, l),
                  "TP " + std::to_string(l.tp) + " CP " + std::to_string(l.cp) + " EP " + std::to_string(l.ep) + " " +
                      dispatcher_name(d));
    }
}
