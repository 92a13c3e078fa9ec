// The training loop's pieces on their own: CRC-32C and TensorBoard event records
// (docs/formats.md), the learning-rate schedule, model FLOPs, checkpoints and safetensors,
// and `moecore train` argument parsing (YAML config + overriding flags, validation messages).
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "moecore/core/error.h"
#include "moecore/core/philox.h"
#include "moecore/model/gpt.h"
#include "moecore/ops/random.h"
#include "moecore/train/arguments.h"
#include "moecore/train/checkpoint.h"
#include "moecore/train/lr_schedule.h"
#include "moecore/train/tensorboard.h"
#include "moecore/train/trainer.h"

#include "train_command.h"  // parse_train_args, parse_data_path (apps/)
#include "op_harness.h"

using namespace moecore;
namespace fs = std::filesystem;

namespace {

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("moecore-tests2-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// The message of the Error that fn raises ("" when it raises none).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// CRC-32C written independently of the library: bit by bit, reflected polynomial 0x82F63B78.
uint32_t crc32c_bitwise(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}
uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace

// ---- CRC-32C and TensorBoard ----------------------------------------------------------------

TEST(TrainingPieces, Crc32cCheckValue) {
  const std::string s = "123456789";
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  EXPECT_EQ(crc32c(p, s.size()), 0xE3069283u);  // the CRC-32C check value
  EXPECT_EQ(masked_crc32c(p, s.size()), 0xC78AB0E5u);  // ((c >> 15) | (c << 17)) + 0xa282ead8
  EXPECT_EQ(masked_crc32c(p, s.size()), masked(0xE3069283u));
  EXPECT_EQ(crc32c(p, 0), 0u);
  // Longer, non-ASCII data: table-driven (library) and bitwise (here) agree.
  std::string bytes;
  for (int i = 0; i < 1000; ++i) bytes.push_back(static_cast<char>((i * 131 + 7) & 0xFF));
  const auto* q = reinterpret_cast<const uint8_t*>(bytes.data());
  EXPECT_EQ(crc32c(q, bytes.size()), crc32c_bitwise(q, bytes.size()));
}

TEST(TrainingPieces, TensorBoardRecordsParseBack) {
  TempDir dir;
  const std::string tb_dir = dir.file("tb/nested");
  std::string path;
  {
    TensorBoardWriter w(tb_dir);
    path = w.path();
    w.add_scalar("lm loss", 2.5, 3);
    w.add_scalar("grad-norm", 0.125, 70000);
    w.flush();
  }
  // events.out.tfevents.<10-digit unix time>.<hostname>
  const std::string name = fs::path(path).filename().string();
  EXPECT_EQ(fs::path(path).parent_path(), fs::path(tb_dir));
  ASSERT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  const std::string rest = name.substr(20);
  ASSERT_GT(rest.size(), 11u) << name;
  for (size_t i = 0; i < 10; ++i) EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(rest[i]))) << name;
  EXPECT_EQ(rest[10], '.') << name;

  // Records: u64 length | u32 masked crc(length bytes) | data | u32 masked crc(data), little-endian.
  const std::string bytes = read_file(path);
  std::vector<std::string> records;
  size_t pos = 0;
  while (pos < bytes.size()) {
    ASSERT_LE(pos + 12, bytes.size()) << "truncated record header at " << pos;
    uint64_t len = 0;
    uint32_t len_crc = 0, data_crc = 0;
    std::memcpy(&len, bytes.data() + pos, 8);
    std::memcpy(&len_crc, bytes.data() + pos + 8, 4);
    EXPECT_EQ(len_crc, masked(crc32c_bitwise(reinterpret_cast<const uint8_t*>(bytes.data() + pos), 8)));
    ASSERT_LE(pos + 12 + len + 4, bytes.size()) << "truncated record at " << pos;
    const std::string data = bytes.substr(pos + 12, len);
    std::memcpy(&data_crc, bytes.data() + pos + 12 + len, 4);
    EXPECT_EQ(data_crc, masked(crc32c_bitwise(reinterpret_cast<const uint8_t*>(data.data()), data.size())));
    records.push_back(data);
    pos += 12 + len + 4;
  }
  ASSERT_EQ(records.size(), 3u);
  // Event.file_version (field 3, wire type 2) = "brain.Event:2"
  EXPECT_NE(records[0].find(std::string("\x1a\x0d") + "brain.Event:2"), std::string::npos);
  // Event.step (field 2, varint) = 3; summary.value { tag (1) = "lm loss", simple_value (2) = 2.5f }
  const float v = 2.5f;
  std::string value_bytes(4, '\0');
  std::memcpy(value_bytes.data(), &v, 4);
  EXPECT_NE(records[1].find(std::string("\x10\x03", 2)), std::string::npos);
  EXPECT_NE(records[1].find(std::string("\x0a\x07") + "lm loss" + "\x15" + value_bytes), std::string::npos);
  // step 70000 as a varint: f0 a2 04
  EXPECT_NE(records[2].find(std::string("\x10\xf0\xa2\x04", 4)), std::string::npos);
  EXPECT_NE(records[2].find("grad-norm"), std::string::npos);
}

// ---- learning-rate schedule -----------------------------------------------------------------

namespace {
TrainArgs lr_args(LrDecayStyle style) {
  TrainArgs a;
  a.lr = 1.0;
  a.min_lr = 0.1;
  a.lr_warmup_iters = 10;
  a.lr_decay_iters = 110;
  a.lr_wsd_decay_iters = 20;
  a.lr_decay_style = style;
  return a;
}
}  // namespace

TEST(TrainingPieces, LearningRateSchedule) {
  const double eps = 1e-12;
  for (LrDecayStyle s : {LrDecayStyle::Constant, LrDecayStyle::Linear, LrDecayStyle::Cosine, LrDecayStyle::WSD}) {
    const TrainArgs a = lr_args(s);
    EXPECT_NEAR(learning_rate(a, 1), 0.1, eps);  // warm-up: lr * step / warmup
    EXPECT_NEAR(learning_rate(a, 5), 0.5, eps);
    EXPECT_NEAR(learning_rate(a, 10), 1.0, eps);
  }
  const TrainArgs constant = lr_args(LrDecayStyle::Constant);
  EXPECT_NEAR(learning_rate(constant, 60), 1.0, eps);
  EXPECT_NEAR(learning_rate(constant, 500), 1.0, eps);

  // linear: min + (max - min) (1 - r), r = (step - 10) / 100
  const TrainArgs linear = lr_args(LrDecayStyle::Linear);
  EXPECT_NEAR(learning_rate(linear, 11), 0.1 + 0.9 * 0.99, eps);
  EXPECT_NEAR(learning_rate(linear, 60), 0.55, eps);
  EXPECT_NEAR(learning_rate(linear, 85), 0.1 + 0.9 * 0.25, eps);
  EXPECT_NEAR(learning_rate(linear, 110), 0.1, eps);
  EXPECT_NEAR(learning_rate(linear, 111), 0.1, eps);

  // cosine: min + (max - min) / 2 (1 + cos(pi r))
  const TrainArgs cosine = lr_args(LrDecayStyle::Cosine);
  EXPECT_NEAR(learning_rate(cosine, 35), 0.8681980515339464, eps);  // r = 1/4
  EXPECT_NEAR(learning_rate(cosine, 60), 0.55, eps);                // r = 1/2
  EXPECT_NEAR(learning_rate(cosine, 85), 0.1 + 0.45 * (1 - std::sqrt(0.5)), eps);
  EXPECT_NEAR(learning_rate(cosine, 110), 0.1, eps);
  EXPECT_NEAR(learning_rate(cosine, 200), 0.1, eps);

  // WSD: max until step 90 (= 110 - 20), then linear to min over the last 20 steps
  TrainArgs wsd = lr_args(LrDecayStyle::WSD);
  wsd.lr_wsd_decay_style = "linear";
  EXPECT_NEAR(learning_rate(wsd, 50), 1.0, eps);
  EXPECT_NEAR(learning_rate(wsd, 90), 1.0, eps);
  EXPECT_NEAR(learning_rate(wsd, 95), 0.1 + 0.9 * 0.75, eps);
  EXPECT_NEAR(learning_rate(wsd, 100), 0.55, eps);
  EXPECT_NEAR(learning_rate(wsd, 110), 0.1, eps);
  EXPECT_NEAR(learning_rate(wsd, 120), 0.1, eps);
  // Megatron's other WSD decay shapes, halfway through the decay (step 100, w = 0.5)
  wsd.lr_wsd_decay_style = "exponential";
  EXPECT_NEAR(learning_rate(wsd, 100), 0.1 + 0.9 * (2.0 * std::sqrt(0.5) - 1.0), eps);
  EXPECT_NEAR(learning_rate(wsd, 110), 0.1, eps);
  wsd.lr_wsd_decay_style = "cosine";
  EXPECT_NEAR(learning_rate(wsd, 100), 0.1 + 0.9 * 0.5, eps);
  wsd.lr_wsd_decay_style = "minus_sqrt";
  EXPECT_NEAR(learning_rate(wsd, 100), 0.1 + 0.9 * (1.0 - std::sqrt(0.5)), eps);

  // No warm-up: step 1 already decays.
  TrainArgs nowarm = lr_args(LrDecayStyle::Linear);
  nowarm.lr_warmup_iters = 0;
  EXPECT_NEAR(learning_rate(nowarm, 1), 0.1 + 0.9 * (1 - 1.0 / 110), eps);
}

// ---- model FLOPs ----------------------------------------------------------------------------

TEST(TrainingPieces, ModelFlopsByHand) {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.ffn_hidden_size = 12;
  c.num_attention_heads = 2;
  c.num_query_groups = 1;  // GQA: K and V have one head
  c.kv_channels = 4;
  c.seq_length = 5;
  c.vocab_size = 11;
  c.add_bias_linear = false;
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 6;
  c.moe.shared_expert_size = 5;
  ModelConfig swiglu = c;
  swiglu.swiglu = true;
  finalize_model_config(swiglu, "[0,1]");
  // output head 11*8 = 88 (input embedding excluded)
  // attention per layer: Q 8*2*4 + O 2*4*8 + K 8*1*4 + V 8*1*4 = 192, two layers 384
  // layer 0 dense SwiGLU: 3 * 8 * 12 = 288
  // layer 1 MoE: router 4*8 = 32, k = 2 experts 2 * 3 * 8 * 6 = 288, shared 3 * 8 * 5 = 120
  EXPECT_EQ(active_matmul_params(swiglu), 88 + 384 + 288 + 32 + 288 + 120);
  // 6 * 1200 * tokens + 6 * layers * seq * hidden * tokens
  EXPECT_DOUBLE_EQ(model_flops_per_step(swiglu, 10), 6.0 * 1200 * 10 + 6.0 * 2 * 5 * 8 * 10);

  ModelConfig gelu = c;
  gelu.swiglu = false;
  finalize_model_config(gelu, "[0,1]");
  EXPECT_EQ(active_matmul_params(gelu), 88 + 384 + 2 * 8 * 12 + 32 + 2 * 2 * 8 * 6 + 2 * 8 * 5);

  ModelConfig dense = c;
  dense.swiglu = true;
  dense.moe = MoeConfig{};
  finalize_model_config(dense, "1");
  EXPECT_EQ(active_matmul_params(dense), 88 + 384 + 2 * 288);
}

// ---- checkpoints ----------------------------------------------------------------------------

namespace {
ModelConfig ckpt_config() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.ffn_hidden_size = 12;
  c.num_attention_heads = 2;
  c.seq_length = 5;
  c.vocab_size = 11;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 6;
  c.moe.router.score = ops::RouterScore::Sigmoid;
  c.moe.enable_expert_bias = true;  // a buffer in the checkpoint
  return c;
}

struct Model {
  std::unique_ptr<ParamStore> store;
  std::unique_ptr<GPTModel> model;
};
Model make_model(ModelConfig c, uint64_t seed, const std::string& freq = "[0,1]") {
  finalize_model_config(c, freq);
  Model m;
  m.store = std::make_unique<ParamStore>(Device::cpu(), DType::F32, DType::F32, seed);
  m.model = std::make_unique<GPTModel>(c, *m.store);
  m.store->initialize();
  return m;
}

std::string bytes_of(const Tensor& t) {
  const Tensor h = t.to(Device::cpu());
  return std::string(static_cast<const char*>(h.data_ptr()), h.nbytes());
}
}  // namespace

TEST(TrainingPieces, CheckpointRoundTripsBitForBit) {
  TempDir dir;
  Model a = make_model(ckpt_config(), 1);
  // Non-trivial optimizer state and buffers (initialize() leaves them zero).
  for (const auto& p : a.store->all()) {
    ops::fill_uniform(p->master, 5, rng_key(p->name), -1.0, 1.0);
    if (p->trainable) {
      ops::fill_uniform(p->exp_avg, 6, rng_key(p->name), -1.0, 1.0);
      ops::fill_uniform(p->exp_avg_sq, 7, rng_key(p->name), 0.0, 1.0);
    }
  }
  a.store->refresh_compute_weights();
  const TrainingState state{12, 345, 2, 1};
  save_checkpoint(dir.str(), *a.store, state);
  EXPECT_TRUE(fs::exists(dir.file("iter_0000012/model_optim.safetensors")));
  EXPECT_EQ(read_file(dir.file("latest_checkpointed_iteration.txt")), "12\n");

  for (const std::string& from : {dir.str(), dir.file("iter_0000012")}) {  // save dir or iter dir
    SCOPED_TRACE(from);
    Model b = make_model(ckpt_config(), 2);  // another seed: different values before loading
    for (const auto& p : b.store->all())
      if (p->trainable) ops::fill_uniform(p->grad, 8, rng_key(p->name), -1.0, 1.0);
    const TrainingState loaded = load_checkpoint(from, *b.store);
    EXPECT_EQ(loaded.iteration, 12);
    EXPECT_EQ(loaded.consumed_samples, 345);
    EXPECT_EQ(loaded.skipped_iterations, 2);
    EXPECT_EQ(loaded.nan_iterations, 1);
    ASSERT_EQ(a.store->all().size(), b.store->all().size());
    int buffers = 0;
    for (size_t i = 0; i < a.store->all().size(); ++i) {
      const Param& pa = *a.store->all()[i];
      const Param& pb = *b.store->all()[i];
      ASSERT_EQ(pa.name, pb.name);
      EXPECT_EQ(bytes_of(pb.master), bytes_of(pa.master)) << pa.name;
      EXPECT_EQ(bytes_of(pb.weight), bytes_of(pa.master)) << pa.name << " (compute copy)";
      if (pa.trainable) {
        EXPECT_EQ(bytes_of(pb.exp_avg), bytes_of(pa.exp_avg)) << pa.name;
        EXPECT_EQ(bytes_of(pb.exp_avg_sq), bytes_of(pa.exp_avg_sq)) << pa.name;
        for (float g : pb.grad.to_vector<float>()) ASSERT_EQ(g, 0.0f) << pa.name << " grad not zeroed";
      } else {
        ++buffers;
      }
    }
    EXPECT_EQ(buffers, 1);  // the expert bias of the MoE layer
  }
}

// bf16 AdamW states (precision-aware optimizer): the checkpoint holds them widened to f32, and a
// store with f32 states loads them (exactly), as does one with bf16 states (bit for bit).
TEST(TrainingPieces, Bf16OptimizerStatesAreSavedAsF32) {
  TempDir dir;
  Model a = make_model(ckpt_config(), 1);
  a.store->set_optimizer_state_dtypes(DType::BF16, DType::BF16);
  for (const auto& p : a.store->all())
    if (p->trainable) {
      ops::fill_uniform(p->exp_avg, 6, rng_key(p->name), -1.0, 1.0);
      ops::fill_uniform(p->exp_avg_sq, 7, rng_key(p->name), 0.0, 1.0);
      ASSERT_EQ(p->exp_avg.dtype(), DType::BF16);
    }
  save_checkpoint(dir.str(), *a.store, TrainingState{4, 4, 0, 0});
  Model f32 = make_model(ckpt_config(), 2);
  load_checkpoint(dir.str(), *f32.store);  // would refuse bf16 tensors: they are f32 in the file
  Model b16 = make_model(ckpt_config(), 3);
  b16.store->set_optimizer_state_dtypes(DType::BF16, DType::BF16);
  load_checkpoint(dir.str(), *b16.store);
  for (size_t i = 0; i < a.store->all().size(); ++i) {
    const Param& pa = *a.store->all()[i];
    if (!pa.trainable) continue;
    const Param& pf = *f32.store->all()[i];
    const Param& pb = *b16.store->all()[i];
    EXPECT_EQ(moecore::testing::to_doubles(pf.exp_avg), moecore::testing::to_doubles(pa.exp_avg)) << pa.name;
    EXPECT_EQ(moecore::testing::to_doubles(pf.exp_avg_sq), moecore::testing::to_doubles(pa.exp_avg_sq)) << pa.name;
    EXPECT_EQ(bytes_of(pb.exp_avg), bytes_of(pa.exp_avg)) << pa.name;
    EXPECT_EQ(bytes_of(pb.exp_avg_sq), bytes_of(pa.exp_avg_sq)) << pa.name;
  }
}

// A streamed checkpoint that fails before finish() (a tensor never written) is discarded: the
// previous checkpoint stays the latest, whole and loadable.
TEST(TrainingPieces, UnfinishedStreamedCheckpointLeavesThePreviousOne) {
  TempDir dir;
  Model a = make_model(ckpt_config(), 1);
  save_checkpoint(dir.str(), *a.store, TrainingState{3, 3, 0, 0});
  {
    std::vector<TensorSpec> specs;
    for (const auto& p : a.store->all()) specs.push_back({p->name, DType::F32, p->shape});
    CheckpointWriter out(dir.str(), specs, TrainingState{5, 5, 0, 0});
    out.write(a.store->all()[0]->name, a.store->all()[0]->master);
    try {
      out.finish();
      FAIL() << "an incomplete checkpoint was finished";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("was never written"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(read_file(dir.file("latest_checkpointed_iteration.txt")), "3\n");
  EXPECT_FALSE(fs::exists(dir.file("iter_0000005")));
  for (const auto& entry : fs::directory_iterator(dir.str()))
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << entry.path();
  Model b = make_model(ckpt_config(), 2);
  EXPECT_EQ(load_checkpoint(dir.str(), *b.store).iteration, 3);
}

TEST(TrainingPieces, CheckpointOfAnotherConfigIsRefusedNamingTheTensor) {
  TempDir dir;
  Model a = make_model(ckpt_config(), 1);
  save_checkpoint(dir.str(), *a.store, TrainingState{3, 3, 0, 0});
  auto names_of = [](const ParamStore& s) {
    std::vector<std::string> n;
    for (const auto& p : s.all()) n.push_back(p->name);
    return n;
  };
  const std::vector<std::string> saved = names_of(*a.store);

  {  // same names, one shape differs: the expert FFN width
    ModelConfig c = ckpt_config();
    c.moe.ffn_hidden_size = 7;
    Model b = make_model(c, 1);
    std::string first;
    for (size_t i = 0; i < b.store->all().size() && first.empty(); ++i)
      if (b.store->all()[i]->shape != a.store->all()[i]->shape) first = b.store->all()[i]->name;
    ASSERT_FALSE(first.empty());
    const std::string msg = error_of([&] { load_checkpoint(dir.str(), *b.store); });
    EXPECT_NE(msg.find("'" + first + "'"), std::string::npos) << msg;
  }
  {  // a tensor the checkpoint lacks: a third layer
    ModelConfig c = ckpt_config();
    c.num_layers = 3;
    Model b = make_model(c, 1, "[0,1,1]");
    std::string missing;
    for (const std::string& n : names_of(*b.store))
      if (std::find(saved.begin(), saved.end(), n) == saved.end()) {
        missing = n;
        break;
      }
    ASSERT_FALSE(missing.empty());
    const std::string msg = error_of([&] { load_checkpoint(dir.str(), *b.store); });
    EXPECT_NE(msg.find("'" + missing + "'"), std::string::npos) << msg;
  }
  {  // a tensor this model lacks: no expert bias
    ModelConfig c = ckpt_config();
    c.moe.enable_expert_bias = false;
    Model b = make_model(c, 1);
    const std::string msg = error_of([&] { load_checkpoint(dir.str(), *b.store); });
    EXPECT_NE(msg.find("decoder.layers.1.mlp.router.expert_bias"), std::string::npos) << msg;
  }
}

TEST(TrainingPieces, SafetensorsRoundTripAndTruncation) {
  TempDir dir;
  const std::string path = dir.file("t.safetensors");
  std::vector<NamedTensor> in;
  in.push_back({"a.f32", Tensor::from_vector(std::vector<float>{1.5f, -2.0f, 3.25f, 1e-30f, -0.0f, 7.0f}, {2, 3})});
  in.push_back({"b.f64", Tensor::from_vector(std::vector<double>{M_PI, -1e300, 5e-324}, {3})});
  in.push_back({"c.i32", Tensor::from_vector(std::vector<int32_t>{-7, 0, 2147483647, 4}, {2, 1, 2})});
  write_safetensors(path, in);
  // Layout: u64 header length (a multiple of 8: aligned data), JSON header, data.
  const std::string raw = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + n + 6 * 4 + 3 * 8 + 4 * 4);
  EXPECT_NE(raw.find("\"a.f32\""), std::string::npos);

  const std::vector<NamedTensor> out = read_safetensors(path);
  ASSERT_EQ(out.size(), 3u);
  std::set<std::string> seen;
  for (const NamedTensor& o : out) {
    const NamedTensor* match = nullptr;
    for (const NamedTensor& i : in)
      if (i.name == o.name) match = &i;
    ASSERT_NE(match, nullptr) << o.name;
    seen.insert(o.name);
    EXPECT_EQ(o.tensor.dtype(), match->tensor.dtype()) << o.name;
    EXPECT_EQ(o.tensor.shape(), match->tensor.shape()) << o.name;
    EXPECT_EQ(bytes_of(o.tensor), bytes_of(match->tensor)) << o.name;
  }
  EXPECT_EQ(seen.size(), 3u);

  // Truncated in the data and in the header: refused, naming the file.
  for (uint64_t keep : {static_cast<uint64_t>(raw.size() - 5), static_cast<uint64_t>(20), static_cast<uint64_t>(4)}) {
    SCOPED_TRACE("kept " + std::to_string(keep) + " bytes");
    const std::string cut = dir.file("cut.safetensors");
    fs::copy_file(path, cut, fs::copy_options::overwrite_existing);
    fs::resize_file(cut, keep);
    const std::string msg = error_of([&] { read_safetensors(cut); });
    EXPECT_NE(msg.find(cut), std::string::npos) << msg;
  }
  const std::string missing = dir.file("absent.safetensors");
  const std::string msg = error_of([&] { read_safetensors(missing); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
}

// ---- arguments ------------------------------------------------------------------------------

namespace {
TrainArgs parse(const std::vector<std::string>& argv) {
  bool help = false;
  std::string text;
  return parse_train_args(argv, &help, &text);
}
std::string parse_error(const std::vector<std::string>& argv) {
  return error_of([&] { parse(argv); });
}
std::vector<std::string> base_args(std::vector<std::string> more = {}) {
  std::vector<std::string> a = {"--mock-data", "--vocab-size", "16", "--train-iters", "1", "--device", "cpu"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}
void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
}
}  // namespace

TEST(TrainingPieces, ArgumentsYamlWithOverridingFlags) {
  TempDir dir;
  const std::string yaml = dir.file("model.yaml");
  write_text(yaml,
             "mock-data: true\n"
             "vocab_size: 64\n"  // '_' spelling
             "num-layers: 2\n"
             "hidden-size: 32\n"
             "num-attention-heads: 4\n"
             "num-experts: 4\n"
             "moe-router-topk: 2\n"
             "disable-bias-linear: true\n"
             "swiglu: true\n"
             "moe-layer-freq: [0, 1]\n"
             "micro-batch-size: 2\n"
             "global-batch-size: 8\n"
             "train-iters: 10\n"
             "lr: 1.0e-3\n"
             "lr-decay-style: cosine\n"
             "moe-router-load-balancing-type: seq_aux_loss\n");
  // A flag before --config still wins: the file is applied first.
  const TrainArgs a = parse({"--hidden-size", "16", "--config", yaml, "--lr", "0.002", "--device", "cpu",
                             "--global-batch-size", "4"});
  EXPECT_EQ(a.model.hidden_size, 16);  // flag over YAML
  EXPECT_DOUBLE_EQ(a.lr, 0.002);
  EXPECT_EQ(a.global_batch_size, 4);
  EXPECT_EQ(a.num_microbatches(), 2);
  EXPECT_EQ(a.model.vocab_size, 64);  // from YAML
  EXPECT_EQ(a.model.num_layers, 2);
  EXPECT_EQ(a.model.moe.num_experts, 4);
  EXPECT_EQ(a.model.moe.router.topk, 2);
  EXPECT_TRUE(a.model.swiglu);
  EXPECT_FALSE(a.model.add_bias_linear);
  EXPECT_EQ(a.train_iters, 10);
  EXPECT_EQ(a.lr_decay_style, LrDecayStyle::Cosine);
  EXPECT_EQ(a.model.moe.load_balancing, LoadBalancing::SeqAuxLoss);
  EXPECT_EQ(a.model.moe_layer, (std::vector<bool>{false, true}));
  EXPECT_EQ(a.model.kv_channels, 4);  // derived: 16 / 4
  EXPECT_TRUE(a.device.is_cpu());

  // --config=FILE spelling too.
  EXPECT_EQ(parse({"--config=" + yaml, "--device", "cpu"}).model.hidden_size, 32);

  // An unknown key is refused, naming the key and the file.
  const std::string bad = dir.file("bad.yaml");
  write_text(bad, "mock-data: true\nvocab-size: 16\nhiden-size: 3\n");
  const std::string msg = parse_error({"--config", bad, "--device", "cpu"});
  EXPECT_NE(msg.find("hiden-size"), std::string::npos) << msg;
  EXPECT_NE(msg.find(bad), std::string::npos) << msg;
}

TEST(TrainingPieces, ArgumentsMoeLayerFreq) {
  const std::vector<std::string> moe = {"--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"};
  std::vector<std::string> list = base_args(moe);
  list.insert(list.end(), {"--num-layers", "2", "--moe-layer-freq", "[0,1]"});
  EXPECT_EQ(parse(list).model.moe_layer, (std::vector<bool>{false, true}));
  std::vector<std::string> every2 = base_args(moe);
  every2.insert(every2.end(), {"--num-layers", "4", "--moe-layer-freq", "2"});
  const TrainArgs a = parse(every2);
  EXPECT_EQ(a.model.moe_layer, (std::vector<bool>{true, false, true, false}));
  EXPECT_TRUE(a.model.is_moe(0));
  EXPECT_FALSE(a.model.is_moe(3));
  // A list of the wrong length names the flag.
  std::vector<std::string> wrong = base_args(moe);
  wrong.insert(wrong.end(), {"--num-layers", "3", "--moe-layer-freq", "[0,1]"});
  EXPECT_NE(parse_error(wrong).find("--moe-layer-freq"), std::string::npos);
}

TEST(TrainingPieces, ArgumentsBadCombinationsNameTheFlag) {
  EXPECT_EQ(parse_error(base_args()), "") << "the base arguments must be valid";
  struct Case {
    std::vector<std::string> extra;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--num-experts", "4", "--disable-bias-linear", "--moe-router-load-balancing-type", "sinkhorn",
        "--moe-expert-capacity-factor", "1.0"},
       "--moe-expert-capacity-factor"},
      {{"--num-experts", "4", "--disable-bias-linear", "--moe-token-dispatcher-type", "flex"},
       "--moe-token-dispatcher-type flex"},
      {{"--num-query-groups", "2"}, "--num-query-groups"},
      {{"--micro-batch-size", "2", "--global-batch-size", "5"}, "--global-batch-size 5"},
      {{"--num-experts", "4", "--disable-bias-linear", "--moe-pad-expert-input-to-capacity"},
       "--moe-pad-expert-input-to-capacity"},
      {{"--lr-decay-style", "step"}, "--lr-decay-style"},
      // parallel layouts (one launched rank here)
      {{"--num-experts", "4", "--disable-bias-linear", "--expert-model-parallel-size", "2"},
       "--expert-model-parallel-size 2 x --expert-tensor-parallel-size 1 x --pipeline-model-parallel-size 1 does not "
       "divide the 1 launched ranks"},
      {{"--pipeline-model-parallel-size", "2"}, "--pipeline-model-parallel-size 2 does not divide the 1 launched ranks"},
      {{"--tensor-model-parallel-size", "2"},
       "--tensor-model-parallel-size 2 x --context-parallel-size 1 x --pipeline-model-parallel-size 1 does not divide"},
      {{"--context-parallel-size", "2"}, "--context-parallel-size 2 x --pipeline-model-parallel-size 1 does not divide"},
      {{"--expert-tensor-parallel-size", "2"}, "--expert-tensor-parallel-size 2 needs an MoE model"},
      {{"--num-virtual-stages-per-pipeline-rank", "2"}, "virtual pipeline stages need --pipeline-model-parallel-size > 1"},
      {{"--decoder-first-pipeline-num-layers", "1"}, "--decoder-first-pipeline-num-layers"},
      // Megatron's performance flags that name features moecore lacks
      {{"--overlap-param-gather"}, "--overlap-param-gather needs --use-distributed-optimizer"},
      {{"--overlap-param-gather", "--use-distributed-optimizer"}, "--overlap-param-gather needs --overlap-grad-reduce"},
      {{"--tp-comm-overlap"}, "--tp-comm-overlap needs --tensor-model-parallel-size > 1 and --sequence-parallel"},
      {{"--moe-flex-dispatcher-backend", "deepep"}, "--moe-flex-dispatcher-backend deepep: the flex dispatcher"},
      {{"--manual-gc"}, "--manual-gc controls Python's garbage collector"},
      {{"--cross-entropy-fusion-impl", "cuda"}, "--cross-entropy-fusion-impl 'cuda': expected te or native"},
      {{"--overlap-moe-expert-parallel-comm"}, "--overlap-moe-expert-parallel-comm needs an MoE model (--num-experts)"},
      {{"--num-experts", "4", "--disable-bias-linear", "--overlap-moe-expert-parallel-comm"},
       "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1"},
      {{"--delay-wgrad-compute"}, "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"},
      {{"--moe-shared-expert-overlap"}, "--moe-shared-expert-overlap needs a shared expert"},
      {{"--moe-enable-deepep"}, "--moe-enable-deepep: the flex dispatcher (DeepEP kernels) is not available"},
      {{"--moe-layer-recompute"}, "--moe-layer-recompute needs an MoE model (--num-experts)"},
      {{"--moe-use-upcycling"}, "--moe-use-upcycling (dense-to-MoE upcycling) is not available"},
      {{"--moe-upcycling-granularity", "4"}, "--moe-upcycling-granularity 4: upcycling is not available"},
      {{"--fp8-format", "e5m2"}, "--fp8-format 'e5m2': expected e4m3 or hybrid"},
      {{"--fp8-recipe", "blockwise"}, "--fp8-recipe needs FP8 training: add --fp8-format"},
      {{"--fp8", "--fp8-recipe", "mxfp8"}, "--fp8-recipe mxfp8 needs a Blackwell GPU"},
      {{"--fp8", "--fp8-param-gather"}, "--fp8-param-gather needs --use-distributed-optimizer"},
      {{"--fp8-param-gather"}, "--fp8-param-gather needs FP8 training: add --fp8-format"},
      {{"--num-experts", "4", "--disable-bias-linear", "--moe-router-padding-for-fp8"},
       "--moe-router-padding-for-fp8 needs FP8 training: add --fp8-format"},
      {{"--hidden-dropout", "0.1"}, "--hidden-dropout 0.1: dropout is not available in this version"},
      {{"--attention-dropout", "0.1"}, "--attention-dropout 0.1: dropout is not available in this version"},
      {{"--ckpt-format", "torch_dist"}, "--ckpt-format torch_dist: moecore has one checkpoint format"},
      {{"--auto-detect-ckpt-format"}, "--auto-detect-ckpt-format: moecore has one checkpoint format"},
      // CUDA graphs (train/train_graph.h): local with full_iteration on one GPU only
      {{"--cuda-graph-impl", "transformer_engine"}, "--cuda-graph-impl transformer_engine: expected local or none"},
      {{"--cuda-graph-scope", "attn", "moe_router"}, "--cuda-graph-scope needs --cuda-graph-impl local"},
      {{"--cuda-graph-impl", "local"}, "--cuda-graph-impl local needs --cuda-graph-scope full_iteration"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"},
       "--cuda-graph-scope attn: per-module graphs are not available in this version"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "moe_router"},
       "--cuda-graph-scope moe_router: per-module graphs are not available in this version"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "whole_step"},
       "--cuda-graph-scope whole_step: expected full_iteration"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--cuda-graph-warmup-steps", "0"},
       "--cuda-graph-warmup-steps 0: expected at least 1"},
      {{"--cuda-graph-warmup-steps", "2"}, "--cuda-graph-warmup-steps 2 needs --cuda-graph-impl local"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--fp8-format", "hybrid"},
       "--cuda-graph-impl local: FP8 training (--fp8 / --fp8-format) is not available with CUDA graphs"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"},
       "--cuda-graph-impl local: CUDA graphs need a GPU, and this run is on cpu"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--mtp-num-layers", "1"},
       "--cuda-graph-impl local: --mtp-num-layers 1: multi-token prediction is not available with CUDA graphs"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--position-embedding-type",
        "learned_absolute"},
       "--cuda-graph-impl local: --position-embedding-type learned_absolute uploads the positions"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--timing-log-level", "1"},
       "--cuda-graph-impl local: --timing-log-level 1 reads events each step"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--optimizer-cpu-offload"},
       "--cuda-graph-impl local: --optimizer-cpu-offload updates on the host"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--num-experts", "4",
        "--disable-bias-linear", "--moe-input-jitter-eps", "0.01"},
       "--cuda-graph-impl local: --moe-input-jitter-eps draws a new seed each step"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--num-experts", "4",
        "--disable-bias-linear", "--moe-expert-capacity-factor", "1.0"},
       "--cuda-graph-impl local: --moe-expert-capacity-factor: the capacity layer reads the expert counts"},
      {{"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--emulate-world-size", "2",
        "--emulate-rank", "0", "--global-batch-size", "2"},
       "--cuda-graph-impl local: the whole-step graph runs on one GPU only, not 2 ranks"},
      {{"--external-cuda-graph"}, "--external-cuda-graph (graphs captured by the calling script) is not available"},
      {{"--te-rng-track"}, "--te-rng-track: Transformer Engine's RNG tracker does not exist in moecore"},
      {{"--overlap-p2p-comm"}, "--overlap-p2p-comm is not available in this version"},
      {{"--pipeline-model-parallel-layout", "Et|(tt|)*30mL"}, "--pipeline-model-parallel-layout is not available"},
      {{"--mtp-num-layers", "-1"}, "--mtp-num-layers -1 must be >= 0"},
      {{"--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "-0.5"}, "--mtp-loss-scaling-factor -0.5 must be a finite"},
      {{"--num-distributed-optimizer-instances", "2"}, "--num-distributed-optimizer-instances 2: hybrid-sharded"},
      // activation offloading
      {{"--fine-grained-activation-offloading"}, "--fine-grained-activation-offloading: name the modules with "
                                                 "--offload-modules (attn_norm, core_attn, attn_proj, mlp_norm"},
      {{"--offload-modules", "expert_fc1", "moe_act"}, "--offload-modules needs --fine-grained-activation-offloading"},
      {{"--fine-grained-activation-offloading", "--offload-modules", "core_attn", "qkv_linear"},
       "--offload-modules 'qkv_linear': expected one of attn_norm, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act"},
      {{"--fine-grained-activation-offloading", "--offload-modules", "expert_fc1"},
       "--offload-modules expert_fc1 needs an MoE model (--num-experts)"},
      {{"--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "--recompute-granularity", "full",
        "--recompute-method", "block", "--recompute-num-layers", "1"},
       "--fine-grained-activation-offloading with --recompute-granularity full is not available"},
      {{"--num-experts", "4", "--disable-bias-linear", "--fine-grained-activation-offloading", "--offload-modules",
        "moe_act", "--recompute-granularity", "selective", "--recompute-modules", "moe"},
       "--offload-modules moe_act with --recompute-modules moe (or --moe-layer-recompute): the MoE layer's saved"},
      {{"--num-experts", "4", "--disable-bias-linear", "--fine-grained-activation-offloading", "--offload-modules",
        "expert_fc1", "--moe-layer-recompute"},
       "--offload-modules expert_fc1 with --recompute-modules moe (or --moe-layer-recompute)"},
      {{"--fine-grained-activation-offloading", "--offload-modules", "attn_proj", "--recompute-granularity",
        "selective", "--recompute-modules", "core_attn"},
       "--offload-modules attn_proj with --recompute-modules core_attn: the output projection's input is dropped"},
      {{"--optimizer-cpu-offload", "--optimizer-offload-fraction", "2"}, "--optimizer-offload-fraction 2: expected 0 < F <= 1"},
      {{"--optimizer-offload-fraction", "0.5"}, "--optimizer-offload-fraction 0.5 needs --optimizer-cpu-offload"},
      {{"--optimizer-cpu-offload", "--bf16"}, "--optimizer-cpu-offload with --bf16 keeps whole fp32 masters on the host"},
      {{"--fake-init-process-group"}, "--fake-init-process-group is not available in this version"},
      {{"--manual-gc-interval", "100"}, "--manual-gc-interval controls Python's garbage collector"},
      // activation recomputation
      {{"--recompute-granularity", "full"}, "--recompute-granularity full: give --recompute-method uniform or block"},
      {{"--recompute-granularity", "full", "--recompute-method", "block"},
       "--recompute-num-layers 0 is out of range: expected 1 to the"},
      {{"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "99"},
       "--recompute-num-layers 99 is out of range: expected 1 to the"},
      {{"--recompute-method", "uniform"}, "--recompute-method uniform needs --recompute-granularity full"},
      {{"--recompute-granularity", "full", "--recompute-method", "chunked"}, "--recompute-method 'chunked': expected uniform or block"},
      {{"--recompute-num-layers", "2"}, "--recompute-num-layers 2 needs --recompute-granularity full"},
      {{"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1",
        "--recompute-modules", "moe"}, "--recompute-modules needs --recompute-granularity selective"},
      {{"--recompute-granularity", "selective", "--recompute-modules", "moe"}, "--recompute-modules moe needs an MoE model"},
      {{"--recompute-granularity", "selective", "--recompute-modules", "attn"},
       "--recompute-modules 'attn': expected core_attn, moe_act, moe, mlp, shared_experts, mla_up_proj or layernorm"},
      {{"--recompute-granularity", "some"}, "--recompute-granularity 'some': expected selective or full"},
      {{"--recompute-modules", "moe_act"}, "--recompute-modules needs --recompute-granularity selective"},
      {{"--recompute-granularity", "selective"}, "name the modules with --recompute-modules"},
      {{"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1",
        "--recompute-modules", "layernorm"}, "--recompute-modules needs --recompute-granularity selective"},
      {{"--recompute-granularity", "selective", "--recompute-modules", "shared_experts"},
       "--recompute-modules shared_experts needs shared experts (--moe-shared-expert-intermediate-size)"},
      {{"--recompute-granularity", "selective", "--recompute-modules", "moe_act"},
       "--recompute-modules moe_act needs an MoE model"},
      {{"--num-experts", "4", "--disable-bias-linear", "--moe-token-dispatcher-type", "ring"},
       "--moe-token-dispatcher-type 'ring': expected allgather, alltoall or flex"},
  };
  for (const Case& c : cases) {
    const std::string msg = parse_error(base_args(c.extra));
    EXPECT_NE(msg.find(c.expected), std::string::npos) << "expected an error naming " << c.expected << ", got: '"
                                                         << msg << "'";
  }
  // bf16 compute runs on the CPU too (for testing the mixed-precision paths).
  EXPECT_EQ(parse_error(base_args({"--bf16"})), "");
  // Offloading with selective recomputation of the same module: its kept tensors are offloaded.
  EXPECT_EQ(parse_error(base_args({"--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "core_attn",
                                   "attn_proj", "mlp_norm"})),
            "");
  EXPECT_EQ(parse_error(base_args({"--num-experts", "4", "--disable-bias-linear", "--fine-grained-activation-offloading",
                                   "--offload-modules", "expert_fc1", "moe_act", "core_attn", "--recompute-granularity",
                                   "selective", "--recompute-modules", "moe_act", "core_attn"})),
            "");
  // Overlap with the distributed optimizer is accepted (Megatron's recipe).
  EXPECT_EQ(parse_error(base_args({"--overlap-grad-reduce", "--use-distributed-optimizer"})), "");
  EXPECT_EQ(parse_error(base_args({"--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather"})), "");
  // The model flags of Megatron's example script: no dropout, no masked-softmax kernel, and
  // --no-position-embedding (learned_absolute becomes none; RoPE stays).
  EXPECT_EQ(parse_error(base_args({"--attention-dropout", "0.0", "--hidden-dropout", "0", "--no-masked-softmax-fusion"})),
            "");
  EXPECT_EQ(parse(base_args({"--no-position-embedding"})).model.position_embedding_type, "rope");
  EXPECT_EQ(parse(base_args({"--position-embedding-type", "learned_absolute", "--no-position-embedding"}))
                .model.position_embedding_type,
            "none");
  EXPECT_EQ(parse(base_args({"--position-embedding-type", "learned_absolute"})).model.position_embedding_type,
            "learned_absolute");
  // The fusion flags of Megatron's performance recipe are accepted (moecore always fuses).
  EXPECT_EQ(parse_error(base_args({"--moe-grouped-gemm", "--moe-router-fusion", "--moe-permute-fusion",
                                   "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"})),
            "");
  // The same groups with --group-query-attention are fine.
  EXPECT_EQ(parse_error(base_args({"--group-query-attention", "--num-query-groups", "2"})), "");
}

TEST(TrainingPieces, DataPathWeightsOrEqualShares) {
  const auto single = moecore::parse_data_path({"corpus"});
  ASSERT_EQ(single.size(), 1u);
  EXPECT_EQ(single[0].second, "corpus");
  const auto weighted = moecore::parse_data_path({"0.3", "a", "0.7", "b"});
  ASSERT_EQ(weighted.size(), 2u);
  EXPECT_DOUBLE_EQ(weighted[1].first, 0.7);
  EXPECT_EQ(weighted[1].second, "b");
  const auto equal = moecore::parse_data_path({"a", "b", "c"});  // Megatron: unweighted prefixes share equally
  ASSERT_EQ(equal.size(), 3u);
  EXPECT_DOUBLE_EQ(equal[2].first, 1.0);
  EXPECT_THROW(moecore::parse_data_path({"0.5", "a", "-1", "b"}), moecore::Error);
}
