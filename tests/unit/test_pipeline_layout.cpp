// stage_layers (train/pipeline.h): which decoder layers each pipeline rank's model chunks hold,
// even and uneven (--decoder-first/last-pipeline-num-layers), with and without virtual stages,
// against hand-worked layouts (Megatron's get_transformer_layer_offset arithmetic), plus the
// property that every layout covers each layer exactly once in virtual-stage order.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/train/pipeline.h"

using namespace moecore;

namespace {

// Rank r's chunks as "[a,b)" strings with E (embedding) / H (head) marks.
std::string describe(const std::vector<PipelineStage>& chunks) {
  std::string s;
  for (const PipelineStage& st : chunks) {
    s += "[" + std::to_string(st.first_layer) + "," + std::to_string(st.end_layer) + ")";
    if (st.has_embedding) s += "E";
    if (st.has_head) s += "H";
    s += " ";
  }
  return s;
}

std::vector<std::string> layout(int64_t layers, int64_t pp, int64_t vpp, int64_t first, int64_t last) {
  std::vector<std::string> out;
  for (int64_t r = 0; r < pp; ++r) out.push_back(describe(stage_layers(layers, pp, vpp, first, last, r)));
  return out;
}

// Virtual stage v = c * pp + r must hold the layers right after virtual stage v - 1's.
void expect_covers_in_order(int64_t layers, int64_t pp, int64_t vpp, int64_t first, int64_t last) {
  std::vector<PipelineStage> by_vstage(static_cast<size_t>(pp * vpp));
  for (int64_t r = 0; r < pp; ++r) {
    const std::vector<PipelineStage> chunks = stage_layers(layers, pp, vpp, first, last, r);
    ASSERT_EQ(static_cast<int64_t>(chunks.size()), vpp);
    for (int64_t c = 0; c < vpp; ++c) by_vstage[static_cast<size_t>(c * pp + r)] = chunks[static_cast<size_t>(c)];
  }
  int64_t next = 0;
  for (size_t v = 0; v < by_vstage.size(); ++v) {
    EXPECT_EQ(by_vstage[v].first_layer, next) << "virtual stage " << v;
    EXPECT_GT(by_vstage[v].end_layer, by_vstage[v].first_layer) << "virtual stage " << v << " is empty";
    EXPECT_EQ(by_vstage[v].has_embedding, v == 0);
    EXPECT_EQ(by_vstage[v].has_head, v + 1 == by_vstage.size());
    next = by_vstage[v].end_layer;
  }
  EXPECT_EQ(next, layers);
}

std::string error_of(int64_t layers, int64_t pp, int64_t vpp, int64_t first, int64_t last) {
  try {
    stage_layers(layers, pp, vpp, first, last, 0);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(PipelineLayout, Even) {
  EXPECT_EQ(layout(4, 1, 1, 0, 0), (std::vector<std::string>{"[0,4)EH "}));
  EXPECT_EQ(layout(4, 2, 1, 0, 0), (std::vector<std::string>{"[0,2)E ", "[2,4)H "}));
  EXPECT_EQ(layout(8, 4, 1, 0, 0), (std::vector<std::string>{"[0,2)E ", "[2,4) ", "[4,6) ", "[6,8)H "}));
}

TEST(PipelineLayout, EvenVirtual) {
  // Megatron's example: 8 layers, 2 stages, 4 chunks: rank 0 [0] [2] [4] [6], rank 1 [1] [3] [5] [7].
  EXPECT_EQ(layout(8, 2, 4, 0, 0),
            (std::vector<std::string>{"[0,1)E [2,3) [4,5) [6,7) ", "[1,2) [3,4) [5,6) [7,8)H "}));
  // 8 layers, 2 stages, 2 chunks: rank 0 [0, 1] [4, 5], rank 1 [2, 3] [6, 7].
  EXPECT_EQ(layout(8, 2, 2, 0, 0), (std::vector<std::string>{"[0,2)E [4,6) ", "[2,4) [6,8)H "}));
}

TEST(PipelineLayout, Uneven) {
  // PP=2: the given stage gets its count, the other the rest.
  EXPECT_EQ(layout(4, 2, 1, 1, 0), (std::vector<std::string>{"[0,1)E ", "[1,4)H "}));
  EXPECT_EQ(layout(4, 2, 1, 0, 1), (std::vector<std::string>{"[0,3)E ", "[3,4)H "}));
  EXPECT_EQ(layout(5, 2, 1, 2, 3), (std::vector<std::string>{"[0,2)E ", "[2,5)H "}));
  // PP=4, both given: the 2 middle stages split the remaining 4 layers.
  EXPECT_EQ(layout(7, 4, 1, 1, 2), (std::vector<std::string>{"[0,1)E ", "[1,3) ", "[3,5) ", "[5,7)H "}));
  // PP=4, only the last given: stages 0-2 share the rest (rank 0 is a middle stage).
  EXPECT_EQ(layout(7, 4, 1, 0, 1), (std::vector<std::string>{"[0,2)E ", "[2,4) ", "[4,6) ", "[6,7)H "}));
  // PP=3, only the first given.
  EXPECT_EQ(layout(7, 3, 1, 3, 0), (std::vector<std::string>{"[0,3)E ", "[3,5) ", "[5,7)H "}));
}

TEST(PipelineLayout, UnevenVirtual) {
  // 12 layers, PP=3, 2 chunks per rank, first 2, last 6: middle rank 4. Per chunk: 1 / 2 / 3
  // layers (6 = 12 / 2 per virtual round): rank 0 [0,1) [6,7); rank 1 [1,3) [7,9); rank 2 [3,6) [9,12).
  EXPECT_EQ(layout(12, 3, 2, 2, 6), (std::vector<std::string>{"[0,1)E [6,7) ", "[1,3) [7,9) ", "[3,6) [9,12)H "}));
  // Only the last given (Megatron's newest offsets: the middle rank numbering starts at rank 0).
  EXPECT_EQ(layout(10, 3, 2, 0, 2), (std::vector<std::string>{"[0,2)E [5,7) ", "[2,4) [7,9) ", "[4,5) [9,10)H "}));
}

TEST(PipelineLayout, CoversEveryLayerOnceInOrder) {
  const int64_t cases[][5] = {{4, 2, 1, 0, 0},  {8, 2, 4, 0, 0}, {4, 2, 1, 1, 0},  {4, 2, 1, 0, 3},
                              {4, 2, 1, 1, 3},  {7, 4, 1, 1, 2}, {12, 3, 2, 2, 6}, {10, 3, 2, 0, 2},
                              {16, 4, 2, 2, 2}, {9, 4, 1, 3, 0}, {13, 5, 1, 1, 0}};
  for (const auto& c : cases) {
    SCOPED_TRACE(describe(stage_layers(c[0], c[1], c[2], c[3], c[4], 0)));
    expect_covers_in_order(c[0], c[1], c[2], c[3], c[4]);
  }
}

TEST(PipelineLayout, ErrorsNameTheFlags) {
  EXPECT_NE(error_of(3, 2, 1, 0, 0).find("--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
            std::string::npos);
  // PP=2 with both counts: they must sum to --num-layers.
  EXPECT_NE(error_of(4, 2, 1, 1, 2).find("expected them to sum to --num-layers 4"), std::string::npos);
  // the middle stages must share the rest evenly (5 layers over 2 stages)
  EXPECT_NE(error_of(7, 4, 1, 1, 1).find("leaves 5 layers for the 2 other pipeline stage(s)"), std::string::npos);
  // no layer left for a middle stage
  EXPECT_NE(error_of(4, 3, 1, 2, 2).find("leaves 0 layers"), std::string::npos);
  // virtual stages: each stage's count must divide
  EXPECT_NE(error_of(8, 2, 2, 1, 0).find("pipeline stage 0 holds 1 layers (--decoder-first-pipeline-num-layers)"),
            std::string::npos);
  EXPECT_NE(error_of(9, 2, 2, 2, 0).find("pipeline stage 1 holds 7 layers (a middle stage)"), std::string::npos);
  EXPECT_NE(error_of(9, 3, 2, 2, 4).find("pipeline stage 1 holds 3 layers (a middle stage)"), std::string::npos);
  EXPECT_NE(error_of(4, 1, 1, 1, 0).find("need --pipeline-model-parallel-size > 1"), std::string::npos);
  EXPECT_NE(error_of(4, 2, 1, -1, 0).find("must be >= 0"), std::string::npos);
  EXPECT_THROW(stage_layers(4, 2, 1, 0, 0, 2), Error);  // rank outside the pipeline
  EXPECT_THROW(stage_layers(4, 0, 1, 0, 0, 0), Error);
}
