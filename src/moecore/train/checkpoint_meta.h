// A checkpoint's meta.json: the training state it records, parsed from the file's text and
// validated (required keys, types, ranges), every failure an Error naming the file. Kept apart
// from checkpoint.cpp so that tests/fuzz/fuzz_checkpoint_meta.cpp links only this and core/error.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moecore {

struct TrainingState {
  int64_t iteration = 0;
  int64_t consumed_samples = 0;
  int64_t skipped_iterations = 0;
  int64_t nan_iterations = 0;
  std::vector<std::pair<std::string, std::string>> args;  // the train flags (meta.json "args")
  bool model_only = false;  // a "moecore-model-v1" checkpoint: weights without optimizer state
  // Iterations (less skipped ones) before this run's AdamW moments and learning-rate schedule
  // began: --no-load-optim starts both afresh at a loaded iteration (meta.json "optimizer_offset").
  int64_t optimizer_offset = 0;
};

// Parses and validates meta.json's text; `file` names it in every error.
TrainingState parse_checkpoint_meta(const std::string& text, const std::string& file);

}  // namespace moecore
