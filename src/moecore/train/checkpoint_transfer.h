// Checkpoint I/O of a training run, over pipeline stages (the file format: checkpoint.h).
//
// Which tensors a stage holds: a checkpoint tensor ("<param>" or "<param>.exp_avg[_sq]") of
// decoder layer i belongs to the stage whose layer run holds i; embedding tensors to the first
// stage (with tied embeddings the last stage holds a copy of the word embedding: loaded, never
// saved); the final norm and output layer to the last.
//
// Saving: collective (experts gathered over ETP and EP, TP parts over TP, Adam shards over DP);
// the first rank of each stage's TP, CP and DP groups (the keeper) keeps the tensors, and the
// writer (world rank 0, stage 0's keeper) streams them into the file one at a time, then every
// other stage's in stage order. The other stages' keepers send theirs to the writer over the
// pipeline group in two rounds: first the list of their tensors (names, dtypes, full shapes as
// JSON, one u8 message after its i64 length), so the writer can lay out the whole file, then the
// tensors themselves, one u8 message each, as Optimizer::full_state produces them (the device
// and host hold one tensor at a time).
//
// Loading: every rank reads the tensors of its own chunks from the file; a pipeline stage leaves
// the other stages' tensors.
#pragma once

#include <string>
#include <vector>

#include "moecore/model/gpt.h"
#include "moecore/parallel/process_groups.h"
#include "moecore/train/arguments.h"
#include "moecore/train/checkpoint.h"
#include "moecore/train/optimizer.h"

namespace moecore {

// Whether a checkpoint tensor ("<param>" or "<param>.exp_avg[_sq]") belongs to this pipeline stage.
bool owns_tensor(const PipelineStage& st, const ModelConfig& cfg, const std::string& name);
// Whether this stage writes the tensor to a checkpoint: what it owns, less the tied copy.
bool saves_tensor(const PipelineStage& st, const ModelConfig& cfg, const std::string& name);
// The same over every model chunk of a rank.
bool chunks_own_tensor(const std::vector<PipelineStage>& chunk_stages, const ModelConfig& cfg, const std::string& name);
bool chunks_save_tensor(const std::vector<PipelineStage>& chunk_stages, const ModelConfig& cfg, const std::string& name);

// --load: the checkpoint's state and tensors into the optimizer (a default state when --load is
// empty, or names a directory without a checkpoint: then a note says training starts afresh).
// Checks the checkpoint's flags against args first.
TrainingState load_training_checkpoint(const TrainArgs& args, const std::vector<PipelineStage>& chunk_stages,
                                       Optimizer& optimizer);

// --save: the optimizer's full state with `state` (nothing when --save is empty). Collective over
// the world; ends with a barrier.
void save_training_checkpoint(const TrainArgs& args, const std::vector<PipelineStage>& chunk_stages,
                              const TrainingState& state, Optimizer& optimizer, const parallel::ProcessGroups& groups);

}  // namespace moecore
