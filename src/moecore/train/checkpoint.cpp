#include "moecore/train/checkpoint.h"

#include "moecore/interop/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include <nlohmann/json.hpp>

#include "moecore/model/fp8_linear.h"
#include "moecore/ops/elementwise.h"
#include "moecore/train/save_dir_guard.h"
#include "moecore/train/tensorboard.h"

namespace fs = std::filesystem;

namespace moecore {

namespace {
const char* st_dtype(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    default: MC_FAIL("checkpoint: dtype ", dtype_name(t), " not supported");
  }
}
DType from_st_dtype(const std::string& s, const std::string& file) {
  if (s == "F32") return DType::F32;
  if (s == "F64") return DType::F64;
  if (s == "BF16") return DType::BF16;
  if (s == "I32") return DType::I32;
  MC_FAIL("'", file, "': unsupported safetensors dtype '", s, "'");
}
std::string iter_name(int64_t it) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "iter_%07lld", static_cast<long long>(it));
  return buf;
}
// fsync a file or directory so that a rename that follows cannot outlive the data it names.
void sync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  MC_CHECK(fd >= 0, "cannot open '", p.string(), "' to flush it to disk");
  const int rc = ::fsync(fd);
  ::close(fd);
  MC_CHECK(rc == 0, "flushing '", p.string(), "' to disk failed (disk full or I/O error?)");
}

void write_text_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp-" + std::to_string(getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    MC_CHECK(f.good(), "cannot write '", tmp.string(), "'");
    f << text;
    f.close();
    MC_CHECK(!f.fail(), "writing '", tmp.string(), "' failed (disk full?)");
  }
  sync_path(tmp);
  fs::rename(tmp, path);
  sync_path(path.parent_path().empty() ? fs::path(".") : path.parent_path());
}
}  // namespace

// The checkpoint's tensors go through interop/safetensors (the one safetensors implementation);
// these wrappers keep moecore dtypes on both sides and flush the file before it is renamed.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::function<void(uint64_t bytes)>& wrote) {
  std::vector<interop::StWriteTensor> out;
  out.reserve(tensors.size());
  for (const NamedTensor& nt : tensors) {
    const Tensor t = nt.tensor.to(Device::cpu()).contiguous();
    const auto* p = static_cast<const uint8_t*>(t.data_ptr());
    out.push_back({nt.name, interop::parse_st_dtype(st_dtype(t.dtype()), path), t.shape(),
                   std::vector<uint8_t>(p, p + t.nbytes())});
  }
  interop::write_safetensors_file(path, out, {{"format", "moecore-checkpoint"}}, wrote);
  sync_path(path);
}

std::vector<NamedTensor> read_safetensors(const std::string& path) {
  MC_CHECK(fs::exists(path), "cannot read '", path, "': no such file");
  const interop::SafetensorsFile file(path);
  std::vector<NamedTensor> out;
  for (const interop::StTensorInfo& info : file.tensors()) {
    Tensor t = Tensor::empty(info.shape, from_st_dtype(interop::st_dtype_name(info.dtype), path));
    std::memcpy(t.data_ptr(), file.data(info), info.nbytes());
    out.push_back({info.name, t});
  }
  return out;
}

struct CheckpointFile {
  interop::SafetensorsStreamWriter writer;
  std::string path;
  std::map<std::string, TensorSpec> specs;  // to check each written tensor's dtype and shape
  std::map<std::string, uint32_t> crc32c;   // each written tensor's checksum (meta.json "crc32c")
};

namespace {
[[noreturn]] void rethrow_filesystem(const std::string& dir, const fs::filesystem_error& e) {
  MC_FAIL("saving a checkpoint to '", dir, "' failed: ", e.what());
}
}  // namespace

CheckpointWriter::CheckpointWriter(const std::string& dir, const std::vector<TensorSpec>& specs,
                                   const TrainingState& state)
    : dir_(dir), state_(state) {
  try {
    std::error_code ec;
    fs::create_directories(dir, ec);
    MC_CHECK(!ec, "--save '", dir, "': cannot create it: ", ec.message());
    remove_dead_writers_temp_files(dir);
    tmp_dir_ = (fs::path(dir) / (iter_name(state.iteration) + ".tmp-" + std::to_string(getpid()))).string();
    fs::remove_all(tmp_dir_);
    fs::create_directories(tmp_dir_);
    std::vector<interop::StTensorSpec> st;
    for (const TensorSpec& t : specs) st.push_back({t.name, interop::parse_st_dtype(st_dtype(t.dtype), dir), t.shape});
    const std::string path = (fs::path(tmp_dir_) / "model_optim.safetensors").string();
    std::map<std::string, TensorSpec> by_name;
    for (const TensorSpec& t : specs) by_name[t.name] = t;
    file_.reset(new CheckpointFile{interop::SafetensorsStreamWriter(path, st, {{"format", "moecore-checkpoint"}}), path,
                                   std::move(by_name)});
  } catch (const fs::filesystem_error& e) {
    rethrow_filesystem(dir, e);
  }
}

CheckpointWriter::~CheckpointWriter() {
  if (finished_ || tmp_dir_.empty()) return;
  std::error_code ec;  // an unfinished checkpoint is discarded; the previous one stays
  file_.reset();
  fs::remove_all(tmp_dir_, ec);
}

void CheckpointWriter::write(const std::string& name, const Tensor& t) {
  const auto it = file_->specs.find(name);
  MC_CHECK(it != file_->specs.end(), "checkpoint '", dir_, "': tensor '", name, "' is not in its list");
  MC_CHECK(it->second.dtype == t.dtype() && it->second.shape == t.shape(), "checkpoint '", dir_, "': tensor '", name,
           "' is ", dtype_name(t.dtype()), " ", shape_str(t.shape()), ", its list says ", dtype_name(it->second.dtype), " ",
           shape_str(it->second.shape));
  const Tensor host = t.to(Device::cpu()).contiguous();
  file_->crc32c[name] = crc32c(static_cast<const uint8_t*>(host.data_ptr()), host.nbytes());
  file_->writer.write(name, host.data_ptr(), host.nbytes());
}

void CheckpointWriter::finish() {
  try {
    file_->writer.close();
    sync_path(file_->path);
    const fs::path final_dir = fs::path(dir_) / iter_name(state_.iteration);
    const fs::path tmp_dir = tmp_dir_;
    const nlohmann::json meta = {{"format", "moecore-checkpoint-v1"},
                                 {"iteration", state_.iteration},
                                 {"consumed_samples", state_.consumed_samples},
                                 {"skipped_iterations", state_.skipped_iterations},
                                 {"nan_iterations", state_.nan_iterations},
                                 {"optimizer_offset", state_.optimizer_offset},
                                 {"args", state_.args},
                                 {"crc32c", file_->crc32c}};
    write_text_atomically(tmp_dir / "meta.json", meta.dump(2) + "\n");
    sync_path(tmp_dir);
    // Replace a previous checkpoint of the same iteration only once the new one is complete.
    if (fs::exists(final_dir)) {
      const fs::path old = final_dir.string() + ".old-" + std::to_string(getpid());
      fs::rename(final_dir, old);
      fs::rename(tmp_dir, final_dir);
      fs::remove_all(old);
    } else {
      fs::rename(tmp_dir, final_dir);
    }
    finished_ = true;
    sync_path(dir_);
    write_text_atomically(fs::path(dir_) / "latest_checkpointed_iteration.txt", std::to_string(state_.iteration) + "\n");
  } catch (const fs::filesystem_error& e) {
    rethrow_filesystem(dir_, e);
  }
}

void save_checkpoint(const std::string& dir, const ParamStore& params, const TrainingState& state) {
  std::vector<NamedTensor> tensors;
  for (const auto& p : params.all()) {
    MC_CHECK(!p->sharded(), "save_checkpoint: parameter '", p->name, "' is sharded; gather it first");
    tensors.push_back({p->name, params.master_value(*p)});  // split masters: joined
    if (p->trainable) {  // moments in the master dtype (bf16 AdamW states are widened exactly)
      tensors.push_back({p->name + ".exp_avg", ops::cast_to(p->exp_avg, params.master_dtype())});
      tensors.push_back({p->name + ".exp_avg_sq", ops::cast_to(p->exp_avg_sq, params.master_dtype())});
    }
  }
  save_checkpoint(dir, tensors, state);
}

void save_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors, const TrainingState& state) {
  std::vector<TensorSpec> specs;
  for (const NamedTensor& t : tensors) specs.push_back({t.name, t.tensor.dtype(), t.tensor.shape()});
  CheckpointWriter out(dir, specs, state);
  for (const NamedTensor& t : tensors) out.write(t.name, t.tensor);
  out.finish();
}

namespace {
// The newest complete checkpoint under a save directory: iter_* directories with meta.json,
// including one left as iter_*.old-<pid> by a crash while re-saving the same iteration.
fs::path newest_complete(const fs::path& dir) {
  fs::path best;
  long long best_it = -1;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("iter_", 0) != 0 || name.find(".tmp-") != std::string::npos) continue;
    if (!fs::exists(entry.path() / "meta.json") || !fs::exists(entry.path() / "model_optim.safetensors")) continue;
    const long long it = std::atoll(name.c_str() + 5);
    if (it > best_it) {
      best_it = it;
      best = entry.path();
    }
  }
  return best;
}

fs::path locate_checkpoint(const std::string& dir) {
  fs::path ckpt = dir;
  MC_CHECK(fs::exists(ckpt), "--load '", dir, "': no such directory");
  if (!fs::exists(ckpt / "meta.json")) {
    const fs::path latest = ckpt / "latest_checkpointed_iteration.txt";
    if (!fs::exists(latest)) {
      const std::string found = find_newest_complete_checkpoint(dir);
      MC_CHECK(!found.empty(), "--load '", dir, "': neither a checkpoint (no meta.json) nor a save directory (no ",
               "latest_checkpointed_iteration.txt and no complete iter_* checkpoint)");
      static std::string noted;  // read_checkpoint_meta and load_checkpoint both locate it: one note
      if (noted != dir)
        std::printf("note: --load %s: no latest_checkpointed_iteration.txt; using the newest complete checkpoint %s\n",
                    dir.c_str(), found.c_str());
      noted = dir;
      return found;
    }
    std::ifstream f(latest);
    long long it = -1;
    f >> it;
    MC_CHECK(f && it >= 0, "--load '", dir, "': latest_checkpointed_iteration.txt does not hold an iteration");
    ckpt /= iter_name(it);
    if (!fs::exists(ckpt / "meta.json")) {
      const fs::path fallback = newest_complete(dir);
      MC_CHECK(!fallback.empty(), "--load '", dir, "': the latest checkpoint '", ckpt.string(),
               "' is missing or incomplete, and no other complete checkpoint is there");
      std::printf("note: --load %s: the latest checkpoint %s is missing or incomplete; using %s\n", dir.c_str(),
                  ckpt.string().c_str(), fallback.string().c_str());
      ckpt = fallback;
    }
  }
  return ckpt;
}

TrainingState parse_meta(const fs::path& ckpt) {
  const fs::path file = ckpt / "meta.json";
  std::ifstream f(file, std::ios::binary);
  MC_CHECK(f.good(), "cannot read '", file.string(), "'");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse_checkpoint_meta(text, file.string());
}
}  // namespace

void verify_checksums(const std::string& ckpt, const std::vector<NamedTensor>& tensors) {
  const fs::path file = fs::path(ckpt) / "meta.json";
  nlohmann::json meta;
  try {
    std::ifstream f(file);
    meta = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    MC_FAIL("'", file.string(), "' is not valid JSON: ", e.what());
  }
  if (!meta.contains("crc32c")) {
    std::printf("note: checkpoint %s has no tensor checksums (written by an older version): loaded without verifying "
                "them\n", ckpt.c_str());
    return;
  }
  const nlohmann::json& sums = meta["crc32c"];
  for (const NamedTensor& t : tensors) {
    MC_CHECK(sums.contains(t.name), "checkpoint '", ckpt, "': tensor '", t.name, "' has no checksum in '",
             file.string(), "'");
    const uint32_t stored = sums[t.name].get<uint32_t>();
    const uint32_t computed = crc32c(static_cast<const uint8_t*>(t.tensor.data_ptr()), t.tensor.nbytes());
    MC_CHECK(stored == computed, "checkpoint '", ckpt, "': tensor '", t.name, "' fails its CRC32C checksum (stored ",
             stored, ", computed ", computed, "): the file is damaged; load an earlier checkpoint");
  }
}

std::string find_newest_complete_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "";
  return newest_complete(dir).string();
}

bool checkpoint_exists(const std::string& dir) {
  const fs::path p = dir;
  return fs::exists(p / "meta.json") || fs::exists(p / "latest_checkpointed_iteration.txt") ||
         !find_newest_complete_checkpoint(dir).empty();
}

void remove_dead_writers_temp_files(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const size_t at = name.rfind(".tmp-");
    const bool ours = name.rfind("iter_", 0) == 0 || name.rfind("latest_checkpointed_iteration.txt", 0) == 0;
    if (!ours || at == std::string::npos) continue;
    const std::string pid_text = name.substr(at + 5);
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::atol(pid_text.c_str());
    if (pid == static_cast<long>(getpid()) || process_alive(pid)) continue;  // a live writer's, or ours
    std::error_code rm;
    fs::remove_all(entry.path(), rm);
    std::printf("note: --save %s: removed %s, left by writer pid %ld (no longer running)%s\n", dir.c_str(),
                name.c_str(), pid, rm ? (" -- failed: " + rm.message()).c_str() : "");
  }
}

TrainingState read_checkpoint_meta(const std::string& dir) { return parse_meta(locate_checkpoint(dir)); }

TrainingState load_checkpoint(const std::string& dir,
                              const std::function<void(const TensorFetch& fetch, bool model_only)>& consume,
                              const std::function<bool(const std::string& name)>& elsewhere) {
  const fs::path ckpt = locate_checkpoint(dir);
  TrainingState s = parse_meta(ckpt);
  const std::vector<NamedTensor> tensors = read_safetensors((ckpt / "model_optim.safetensors").string());
  verify_checksums(ckpt.string(), tensors);
  std::map<std::string, Tensor> by_name;
  for (const NamedTensor& nt : tensors) by_name[nt.name] = nt.tensor;
  bool fresh_fp8_noted = false;
  const TensorFetch fetch = [&](const std::string& name, const Shape& shape, DType dtype) {
    auto it = by_name.find(name);
    if (it == by_name.end() && is_fp8_scaling_state(name)) {  // FP8 delayed scaling starts afresh
      if (!fresh_fp8_noted)
        std::printf("note: checkpoint %s has no FP8 delayed-scaling state (%s): the amax histories start empty\n",
                    ckpt.string().c_str(), name.c_str());
      fresh_fp8_noted = true;
      return Tensor();
    }
    MC_CHECK(it != by_name.end(), "checkpoint '", ckpt.string(), "' has no tensor '", name,
             "': it was saved from a different model configuration");
    MC_CHECK(it->second.shape() == shape && it->second.dtype() == dtype, "checkpoint '", ckpt.string(),
             "': tensor '", name, "' is ", it->second.describe(), "; this model expects ", dtype_name(dtype), " ",
             shape_str(shape));
    Tensor t = it->second;
    by_name.erase(it);
    return t;
  };
  consume(fetch, s.model_only);
  if (elsewhere)
    for (auto it = by_name.begin(); it != by_name.end();) it = elsewhere(it->first) ? by_name.erase(it) : std::next(it);
  // FP8 delayed-scaling state the model has no place for (a run, eval or generate without it)
  for (auto it = by_name.begin(); it != by_name.end();) it = is_fp8_scaling_state(it->first) ? by_name.erase(it) : std::next(it);
  MC_CHECK(by_name.empty(), "checkpoint '", ckpt.string(), "' has tensor '", by_name.begin()->first,
           "' that this model does not: it was saved from a different model configuration");
  if (s.model_only) s.iteration = s.consumed_samples = s.skipped_iterations = s.nan_iterations = s.optimizer_offset = 0;
  return s;
}

TrainingState load_checkpoint(const std::string& dir, ParamStore& params) {
  return load_checkpoint(dir, [&](const TensorFetch& fetch, bool model_only) {
    for (const auto& p : params.all()) {
      MC_CHECK(!p->sharded(), "load_checkpoint: parameter '", p->name, "' is sharded; load through the optimizer");
      const Tensor saved = fetch(p->name, p->shape, params.master_dtype());
      if (!saved.defined()) continue;  // FP8 delayed-scaling state not in the checkpoint: kept empty
      params.set_master(*p, saved.to(params.device()));
      if (!p->trainable) continue;
      if (model_only) {
        ops::fill(p->exp_avg, 0.0);
        ops::fill(p->exp_avg_sq, 0.0);
      } else {
        // Checkpoints hold the moments in the master dtype; bf16 states round them here.
        for (Tensor* state : {&p->exp_avg, &p->exp_avg_sq}) {
          const Tensor saved = fetch(p->name + (state == &p->exp_avg ? ".exp_avg" : ".exp_avg_sq"), p->shape,
                                     params.master_dtype()).to(state->device());
          ops::assign_cast(saved, *state);
        }
      }
    }
    params.refresh_compute_weights();
    params.zero_grad();
  });
}

void save_model_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors,
                           const std::vector<std::pair<std::string, std::string>>& args, const std::string& source_json,
                           const std::function<void(uint64_t bytes)>& wrote) {
  nlohmann::json source;
  try {
    source = nlohmann::json::parse(source_json);
  } catch (const std::exception& e) {
    MC_FAIL("save_model_checkpoint: source is not valid JSON: ", e.what());
  }
  try {
    std::error_code ec;
    fs::create_directories(dir, ec);
    MC_CHECK(!ec, "'", dir, "': cannot create it: ", ec.message());
    const fs::path final_dir = fs::path(dir) / iter_name(0);
    const fs::path tmp_dir = fs::path(dir) / (iter_name(0) + ".tmp-" + std::to_string(getpid()));
    fs::remove_all(tmp_dir);
    fs::create_directories(tmp_dir);
    write_safetensors((tmp_dir / "model_optim.safetensors").string(), tensors, wrote);
    std::map<std::string, uint32_t> checksums;
    for (const NamedTensor& t : tensors) {
      const Tensor host = t.tensor.to(Device::cpu()).contiguous();
      checksums[t.name] = crc32c(static_cast<const uint8_t*>(host.data_ptr()), host.nbytes());
    }
    const nlohmann::json meta = {{"format", "moecore-model-v1"}, {"iteration", 0}, {"consumed_samples", 0},
                                 {"args", args}, {"source", source}, {"crc32c", checksums}};
    write_text_atomically(tmp_dir / "meta.json", meta.dump(2) + "\n");
    sync_path(tmp_dir);
    fs::remove_all(final_dir);
    fs::rename(tmp_dir, final_dir);
    sync_path(dir);
    write_text_atomically(fs::path(dir) / "latest_checkpointed_iteration.txt", "0\n");
  } catch (const fs::filesystem_error& e) {
    MC_FAIL("saving a model checkpoint to '", dir, "' failed: ", e.what());
  }
}

std::string read_checkpoint_source(const std::string& dir) {
  const fs::path ckpt = locate_checkpoint(dir);
  std::ifstream f(ckpt / "meta.json");
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    MC_FAIL("'", (ckpt / "meta.json").string(), "' is not valid JSON: ", e.what());
  }
  return meta.contains("source") ? meta["source"].dump() : "{}";
}

CheckpointTokenizer checkpoint_tokenizer(const std::string& dir) {
  const fs::path ckpt = locate_checkpoint(dir);
  const TrainingState meta = parse_meta(ckpt);
  CheckpointTokenizer out;
  std::string recorded;
  for (const auto& [name, value] : meta.args) {
    if (name == "tokenizer-type") out.type = value;
    if (name == "tokenizer-model") recorded = value;
  }
  if (recorded.empty()) return out;
  const fs::path p = recorded;
  if (p.is_absolute()) {
    out.path = p.lexically_normal().string();
    return out;
  }
  // The save directory: the parent of the iter_* directory that holds meta.json.
  const fs::path in_save_dir = fs::absolute(ckpt.parent_path() / p).lexically_normal();
  const fs::path in_working_dir = fs::absolute(p).lexically_normal();
  out.path = (fs::exists(in_save_dir) || !fs::exists(in_working_dir) ? in_save_dir : in_working_dir).string();
  return out;
}

std::string tokenizer_file_name(const std::string& model_file) {
  return fs::path(model_file).extension() == ".model" ? "tokenizer.model" : "tokenizer.json";
}

std::string copy_tokenizer_files(const std::string& model_file, const std::string& dest_dir) {
  fs::path src = model_file;
  if (fs::is_directory(src)) src /= "tokenizer.json";
  MC_CHECK(fs::is_regular_file(src), "tokenizer file '", src.string(), "' does not exist");
  const std::string name = tokenizer_file_name(src.string());
  try {
    fs::create_directories(dest_dir);
    auto copy = [&](const fs::path& from, const std::string& to_name) {
      const fs::path to = fs::path(dest_dir) / to_name;
      if (fs::exists(to) && fs::equivalent(from, to)) return;
      fs::copy_file(from, to, fs::copy_options::overwrite_existing);
    };
    for (const char* sibling : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"}) {
      const fs::path s = src.parent_path() / sibling;
      if (sibling != name && fs::is_regular_file(s)) copy(s, sibling);
    }
    copy(src, name);
  } catch (const fs::filesystem_error& e) {
    MC_FAIL("copying the tokenizer '", src.string(), "' to '", dest_dir, "' failed: ", e.what());
  }
  return name;
}

std::string checkpoint_tensor_file(const std::string& dir) {
  return (locate_checkpoint(dir) / "model_optim.safetensors").string();
}

}  // namespace moecore
