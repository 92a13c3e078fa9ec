// Checkpoints: full (unsharded) tensors in one safetensors file, written by one rank.
//
//   <save>/iter_0000100/model_optim.safetensors   every parameter's fp32 master ("<name>"), and
//                                                 for trainable ones "<name>.exp_avg" and
//                                                 "<name>.exp_avg_sq"; buffers (expert bias) too
//   <save>/iter_0000100/meta.json                 iteration, consumed samples, counters, format,
//                                                 the train flags, each tensor's CRC32C
//   <save>/latest_checkpointed_iteration.txt      "100"
//   <save>/tokenizer/                             the run's tokenizer files (checkpoint_tokenizer)
// Writes go to a temporary directory that is renamed into place, and the "latest" file is
// replaced by rename, so a crash never leaves a damaged last checkpoint. The file is written one
// tensor at a time (CheckpointWriter): a distributed run streams each gathered tensor into it,
// so no rank holds the model's state in host memory. Loading checks every
// tensor's presence, dtype and shape and names the first that differs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moecore/model/params.h"
#include "moecore/train/checkpoint_meta.h"

namespace moecore {


// True when dir is a checkpoint (iter_* with meta.json) or a save directory that names one or
// holds a complete iter_* checkpoint.
bool checkpoint_exists(const std::string& dir);
// The newest complete checkpoint (iter_* with meta.json and its tensors) under a save directory,
// found by listing it (without latest_checkpointed_iteration.txt); "" when there is none.
std::string find_newest_complete_checkpoint(const std::string& dir);
// Removes iter_N.tmp-PID directories and latest_checkpointed_iteration.txt.tmp-PID files whose
// writer (PID, on this machine) no longer runs, with a note line each; called before each save.
void remove_dead_writers_temp_files(const std::string& dir);
// Reads only meta.json of the latest checkpoint under dir (or of dir itself).
TrainingState read_checkpoint_meta(const std::string& dir);

struct NamedTensor;
struct TensorSpec {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
};

// Writes a checkpoint one tensor at a time (host memory: one tensor, not the model): the specs
// (every tensor's name, dtype and full shape, in file order) first, then each tensor exactly
// once, in any order; finish() checks that all were written, writes meta.json and moves the
// directory into place (a crash or an Error before finish() leaves the previous checkpoint).
class CheckpointWriter {
 public:
  CheckpointWriter(const std::string& dir, const std::vector<TensorSpec>& specs, const TrainingState& state);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  void write(const std::string& name, const Tensor& t);  // t: any device; copied to the host
  void finish();

 private:
  std::string dir_;
  TrainingState state_;
  std::string tmp_dir_;
  std::unique_ptr<struct CheckpointFile> file_;
  bool finished_ = false;
};

void save_checkpoint(const std::string& dir, const ParamStore& params, const TrainingState& state);
// The same from a list of full (unsharded) tensors, as a distributed run gathers them: a
// checkpoint never depends on the layout that wrote it, so any layout can load it.
void save_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors, const TrainingState& state);
// Loads the latest checkpoint under dir (or dir itself if it is an iter_* directory). A model-only
// checkpoint (below) sets the masters, zeroes the AdamW states and starts at iteration 0.
TrainingState load_checkpoint(const std::string& dir, ParamStore& params);
// The general form: `consume` takes each tensor it needs through fetch(name, full shape, dtype),
// which checks presence, shape and dtype (an Error naming the checkpoint and the tensor);
// tensors left untaken are an Error afterwards. model_only: no optimizer state in the file.
// An FP8 delayed-scaling state tensor (model/fp8_linear.h) the checkpoint lacks fetches as an
// undefined Tensor (the caller keeps its empty state), and one the model lacks is skipped.
using TensorFetch = std::function<Tensor(const std::string& name, const Shape& shape, DType dtype)>;
// elsewhere(name): a tensor this rank does not hold but another does (pipeline stages); such
// tensors may stay untaken.
TrainingState load_checkpoint(const std::string& dir,
                              const std::function<void(const TensorFetch& fetch, bool model_only)>& consume,
                              const std::function<bool(const std::string& name)>& elsewhere = {});

// Model-only checkpoint (written by `moecore convert`): <dir>/iter_0000000/model_optim.safetensors
// with the fp32 masters only (no "<name>.exp_avg"/".exp_avg_sq"), meta.json "format":
// "moecore-model-v1", "args" = the train flags, and `source_json` (a JSON object as text, e.g. the
// HF config and each tensor's original dtype) stored as meta.json "source" for a later export.
// wrote: as for write_safetensors.
void save_model_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors,
                           const std::vector<std::pair<std::string, std::string>>& args,
                           const std::string& source_json = "{}",
                           const std::function<void(uint64_t bytes)>& wrote = {});
// meta.json "source" of the latest checkpoint under dir as JSON text ("{}" when absent).
std::string read_checkpoint_source(const std::string& dir);
// The safetensors file of the latest checkpoint under dir.
std::string checkpoint_tensor_file(const std::string& dir);

// The tokenizer a checkpoint records (meta.json "args": tokenizer-type, tokenizer-model) of the
// latest checkpoint under dir (or of dir itself, an iter_* directory). `moecore convert --from hf`
// and `moecore train --save` keep the tokenizer's files in <save dir>/tokenizer/ and record
// tokenizer-model relative to the save directory ("tokenizer/tokenizer.json"); a relative path is
// resolved against the save directory (dir, or the parent of an iter_* dir), else, for
// checkpoints that recorded a path relative to where training ran, against the working
// directory when the file is there. An absolute path stays as it is.
struct CheckpointTokenizer {
  std::string type;  // --tokenizer-type; "" when the checkpoint records none
  std::string path;  // absolute path of the tokenizer file; "" when none (ByteTokenizer, or no tokenizer)
};
CheckpointTokenizer checkpoint_tokenizer(const std::string& dir);

// Copies a tokenizer into dest_dir (created): `model_file` (a tokenizer.json, a SentencePiece
// .model, or a directory holding tokenizer.json) under its HuggingFace name (tokenizer.json, or
// tokenizer.model for a .model file), with the HF files found beside it (tokenizer.json,
// tokenizer.model, tokenizer_config.json, special_tokens_map.json). Returns the file name written
// for model_file. Copying a directory onto itself changes nothing.
std::string copy_tokenizer_files(const std::string& model_file, const std::string& dest_dir);
// The name copy_tokenizer_files gives model_file ("tokenizer.json" or "tokenizer.model").
std::string tokenizer_file_name(const std::string& model_file);

// Checks each tensor against meta.json "crc32c" of checkpoint directory ckpt (an Error naming the
// tensor on a mismatch); a checkpoint written before checksums gets a note line and no check.
void verify_checksums(const std::string& ckpt, const std::vector<NamedTensor>& tensors);

// safetensors I/O of the checkpoint tensors (a thin layer over interop/safetensors).
struct NamedTensor {
  std::string name;
  Tensor tensor;  // CPU, contiguous
};
// wrote(n), when given, is called after each tensor with its byte count (progress lines).
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::function<void(uint64_t bytes)>& wrote = {});
std::vector<NamedTensor> read_safetensors(const std::string& path);

}  // namespace moecore
