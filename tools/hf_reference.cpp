// hf_reference: moecore's side of tools/hf_check.py (holding imported HF models to transformers).
//
//   hf_reference --load CKPT --tokens FILE --out OUT.safetensors [--device cpu|cuda:0]
//
// Loads a model-only checkpoint written by `moecore convert --from hf` (its recorded flags rebuild
// the model; fp32 master and compute weights, no bf16), reads token ids [B, S] from FILE (text:
// "B S" then B*S ids), runs one forward and backward in fp32 on the device and writes OUT:
//   "logits"   F32 [B, S, V]
//   "<HF name>" F32, the gradient of every weight under its HF name (split back by the converter's
//              export mapping, e.g. the expert fc1 gradient into w1/w3 or gate_proj/up_proj);
//              a buffer's value (DeepSeek-V3's e_score_correction_bias)
//   metadata   "loss" (%.17g), "architecture", "device"
// The loss is HF's causal-LM loss: labels = the tokens shifted left by one, the last position of
// every sequence unlabelled, mean cross-entropy over the labelled positions. The balancing losses
// are switched off (moe-aux-loss-coeff 0, moe-z-loss-coeff 0): HF adds its aux loss only with
// output_router_logits, and its formula is not Megatron's.
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moecore/cli/flags.h"
#include "moecore/core/error.h"
#include "moecore/interop/hf_convert.h"
#include "moecore/interop/safetensors.h"
#include "moecore/model/gpt.h"
#include "moecore/train/arguments.h"
#include "moecore/train/checkpoint.h"
#include "train_command.h"

using namespace moecore;

namespace {

int run(const std::vector<std::string>& argv) {
  std::string load, tokens_file, out, device = "cpu";
  cli::FlagSet flags("hf_reference", "Logits, loss and weight gradients of a converted HF checkpoint (fp32).");
  flags.add_string("load", &load, "model-only checkpoint from `moecore convert --from hf`");
  flags.add_string("tokens", &tokens_file, "text file: B S, then B*S token ids");
  flags.add_string("out", &out, "output safetensors file");
  flags.add_string("device", &device, "cpu or cuda:N");
  flags.parse(argv);
  if (flags.help_requested()) {
    std::printf("%s", flags.help().c_str());
    return 0;
  }
  MC_CHECK(!load.empty() && !tokens_file.empty() && !out.empty(), "hf_reference needs --load, --tokens and --out");

  std::ifstream tf(tokens_file);
  int64_t b = 0, s = 0;
  tf >> b >> s;
  MC_CHECK(tf.good() && b > 0 && s > 1, "'", tokens_file, "': expected 'B S' (S > 1) then B*S token ids");
  std::vector<int32_t> ids(static_cast<size_t>(b * s)), labels(ids.size());
  for (int32_t& x : ids) {
    tf >> x;
    MC_CHECK(!tf.fail(), "'", tokens_file, "': fewer than B*S = ", b * s, " token ids");
  }
  for (int64_t i = 0; i < b * s; ++i)
    labels[static_cast<size_t>(i)] = (i % s == s - 1) ? -1 : ids[static_cast<size_t>(i + 1)];

  const std::string origin = "checkpoint '" + load + "'";
  const TrainingState meta = read_checkpoint_meta(load);
  std::vector<std::pair<std::string, std::string>> saved = meta.args;
  for (auto& [name, value] : saved) {
    if (name == "moe-aux-loss-coeff" || name == "moe-z-loss-coeff" || name == "moe-input-jitter-eps") value = "0";
    if (name == "bf16") value = "false";
    if (name == "seq-length") value = std::to_string(s);
  }
  const TrainArgs args = train_args_from_saved(saved, device, origin);
  const nlohmann::json source = nlohmann::json::parse(read_checkpoint_source(load));
  MC_CHECK(source.contains("architecture"), origin, " records no HF architecture (not written by moecore convert)");
  const std::string arch = source["architecture"].get<std::string>();
  for (int32_t x : ids) MC_CHECK(x >= 0 && x < args.model.vocab_size, "token id ", x, " outside the vocabulary");

  ParamStore store(args.device, DType::F32, DType::F32, static_cast<uint64_t>(args.seed));
  GPTModel model(args.model, store);
  store.initialize();
  load_checkpoint(load, store);

  const Tensor tokens = Tensor::from_vector(ids, {b, s}, args.device);
  const Tensor lab = Tensor::from_vector(labels, {b, s}, args.device);
  GPTModel::Ctx ctx;
  const double loss = model.forward(tokens, lab, true, 0, ctx);
  // The backward overwrites the logits with their gradient: copy them first.
  const std::vector<float> logits = ctx.logits.to_vector<float>();
  model.backward(1.0, ctx);

  std::map<std::string, Tensor> grads;
  // Buffers (DeepSeek-V3's expert bias, e_score_correction_bias) have no gradient: their value,
  // as tools/hf_check.py's save_pretrained of the gradients keeps a buffer's value.
  for (const auto& p : store.all())
    grads[p->name] = (p->trainable ? p->grad : p->master).to(Device::cpu()).contiguous();
  std::vector<interop::StWriteTensor> items = interop::export_hf_f32(args.model, arch, [&](const std::string& n) {
    const auto it = grads.find(n);
    MC_CHECK(it != grads.end(), "the model has no parameter '", n, "'");
    return it->second;
  });
  items.insert(items.begin(), interop::StWriteTensor{"logits", interop::StDType::F32, {b, s, args.model.vocab_size},
                                                     interop::f32_to_st_bytes(logits.data(), logits.size(),
                                                                              interop::StDType::F32)});
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", loss);
  interop::write_safetensors_file(out, items, {{"loss", buf}, {"architecture", arch}, {"device", device}});
  std::printf("hf_reference: %s on %s: loss %.9g, %zu gradient tensors -> %s\n", arch.c_str(), device.c_str(), loss,
              items.size() - 1, out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const cli::UsageError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_reference: error: %s\n", e.what());
    return 1;
  }
}
