// ProcessGroups on one rank (no world communicator): every group and every view is null (one
// rank: no collective), and the layout is the one-rank layout. Checkpoint tensors by pipeline
// stage (checkpoint_transfer.h): which stage holds and which writes each tensor.
#include <gtest/gtest.h>

#include <string>

#include "moecore/core/error.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/parallel/process_groups.h"
#include "moecore/train/checkpoint_transfer.h"
#include "moecore/train/optimizer.h"

using namespace moecore;
using namespace moecore::parallel;

TEST(ProcessGroups, OneRankHasNoCommunicators) {
  ProcessGroupOptions options;
  options.tied_embeddings = true;
  options.overlap_param_gather = true;
  const ProcessGroups g(nullptr, ParallelConfig{}, 0, options);
  EXPECT_EQ(g.world(), nullptr);
  for (comm::Communicator* c : {g.tp(), g.cp(), g.dp(), g.dp_cp(), g.pp(), g.token_group(), g.ep(), g.etp(), g.edp(),
                                g.tp_ep(), g.embedding(), g.dp_gather(), g.edp_gather()})
    EXPECT_EQ(c, nullptr);
  EXPECT_EQ(g.dp_size(), 1);
  EXPECT_EQ(g.layout().tp, std::vector<int64_t>{0});
  EXPECT_EQ(g.layout().expt_dp, std::vector<int64_t>{0});
  const DenseParallel dense = g.dense_parallel(true);
  EXPECT_EQ(dense.tp, nullptr);
  EXPECT_EQ(dense.cp, nullptr);
  EXPECT_FALSE(dense.sp());  // sequence parallelism needs a TP group
  const MoeParallel moe = g.moe_parallel(DispatcherType::AllToAll, false);
  EXPECT_EQ(moe.token_group, nullptr);
  EXPECT_EQ(moe.ep, nullptr);
  EXPECT_EQ(moe.etp, nullptr);
  EXPECT_EQ(moe.tp_ep, nullptr);
  EXPECT_EQ(moe.aux_group, nullptr);
  EXPECT_EQ(moe.dispatcher, DispatcherType::AllToAll);
  const OptimizerGroups opt = g.optimizer_groups();
  for (comm::Communicator* c : {opt.dp, opt.tp, opt.edp, opt.ep, opt.pp, opt.etp, opt.embedding, opt.dp_gather,
                                opt.edp_gather})
    EXPECT_EQ(c, nullptr);
  EXPECT_EQ(opt.dp_size, 1);
}

TEST(ProcessGroups, OneRankLayoutIsValidated) {
  ParallelConfig bad;
  bad.tp = 2;  // does not divide a world of one
  EXPECT_THROW(ProcessGroups(nullptr, bad, 0), Error);
}

TEST(ProcessGroups, SeveralRanksNeedAWorld) {
  ParallelConfig two;
  two.world = 2;
  try {
    ProcessGroups g(nullptr, two, 0);
    FAIL() << "no error without a world communicator";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a world of 2 ranks needs a world communicator"), std::string::npos) << e.what();
  }
}

TEST(CheckpointTransfer, StagesOwnAndSaveTheirTensors) {
  ModelConfig tied;
  tied.num_layers = 4;
  ModelConfig untied = tied;
  untied.untie_embeddings = true;
  const PipelineStage first{0, 2, true, false}, last{2, 4, false, true};
  // Decoder layers by their layer run.
  EXPECT_TRUE(owns_tensor(first, tied, "decoder.layers.1.mlp.fc1.weight"));
  EXPECT_FALSE(owns_tensor(first, tied, "decoder.layers.2.mlp.fc1.weight.exp_avg"));
  EXPECT_TRUE(owns_tensor(last, tied, "decoder.layers.3.self_attention.qkv.weight.exp_avg_sq"));
  // Tied embeddings: the last stage holds the word embedding too, but only the first writes it.
  EXPECT_TRUE(owns_tensor(last, tied, "embedding.word_embeddings.weight"));
  EXPECT_FALSE(saves_tensor(last, tied, "embedding.word_embeddings.weight"));
  EXPECT_TRUE(saves_tensor(first, tied, "embedding.word_embeddings.weight"));
  EXPECT_FALSE(owns_tensor(last, untied, "embedding.word_embeddings.weight"));
  // Final norm and output layer: the last stage.
  EXPECT_TRUE(saves_tensor(last, tied, "decoder.final_layernorm.weight"));
  EXPECT_FALSE(owns_tensor(first, tied, "output_layer.weight"));
  // Over a rank's chunks (virtual stages).
  EXPECT_TRUE(chunks_own_tensor({first, last}, tied, "output_layer.weight"));
  EXPECT_FALSE(chunks_save_tensor({last}, tied, "embedding.word_embeddings.weight"));
  EXPECT_TRUE(chunks_save_tensor({last, first}, tied, "embedding.word_embeddings.weight"));
}
