// Split fp32 masters (ops/master_split.h; --no-store-param-remainders turns them off): the two halves give back
// every f32 bit for bit; the high half is the bf16 a cast gives, except on exact ties; AdamW on
// the halves is AdamW on the f32 master; a ParamStore with split masters steps its optimizer to the
// same masters (and checkpoint tensors) as one with whole fp32 masters; bad arguments are named.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moecore/model/params.h"
#include "moecore/ops/adamw.h"
#include "moecore/ops/master_split.h"
#include "moecore/train/optimizer.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Floats from random bit patterns (every exponent, both signs), the special values, and the
// rounding cases of the low half: 0x0000, 0x7fff, 0x8000 (a tie), 0x8001, 0xffff.
std::vector<float> test_floats() {
  std::vector<float> out = {0.0f, -0.0f, 1.0f, -1.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::min()};
  std::mt19937_64 rng(fresh_seed());
  for (uint32_t low : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
    for (int i = 0; i < 2000; ++i) {
      const uint32_t u = (static_cast<uint32_t>(rng()) & 0xffff0000u) | low;
      out.push_back(bits_float(u));
    }
  for (int i = 0; i < 200000; ++i) out.push_back(bits_float(static_cast<uint32_t>(rng())));
  std::vector<float> finite_or_inf;
  for (float x : out)
    if (!std::isnan(x)) finite_or_inf.push_back(x);
  return finite_or_inf;
}

Tensor floats_tensor(const std::vector<float>& v) { return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}); }

}  // namespace

TEST(MasterSplit, JoinGivesBackEveryFloatBitForBit) {
  const std::vector<float> xs = test_floats();
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor master = floats_tensor(xs), high = Tensor::empty({n}, DType::BF16), remainder = Tensor::empty({n}, DType::I16);
  ops::split_master(master, high, remainder);
  Tensor back = Tensor::empty({n}, DType::F32);
  ops::join_master(high, remainder, back);
  const float* got = back.data<float>();
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += bits_of(got[i]) != bits_of(xs[i]);
  EXPECT_EQ(differ, 0) << "of " << n;
}

TEST(MasterSplit, HighHalfIsTheNearestBf16TiesAwayFromZero) {
  const std::vector<float> xs = test_floats();
  int64_t ties = 0, rounded_up = 0;
  for (float x : xs) {
    uint16_t high;
    int16_t remainder;
    ops::split_master_value(x, high, remainder);
    const uint32_t u = bits_of(x);
    const bool up = (u & 0xffffu) >= 0x8000u;
    rounded_up += up;
    EXPECT_EQ(remainder < 0, up) << "x bits " << std::hex << u;
    if ((u & 0xffffu) == 0x8000u) {  // a tie: away from zero (a cast goes to the even neighbour)
      ++ties;
      EXPECT_EQ(high, static_cast<uint16_t>((u >> 16) + 1)) << "x bits " << std::hex << u;
    } else {
      EXPECT_EQ(high, float_to_bf16_bits(x)) << "x bits " << std::hex << u;
    }
  }
  EXPECT_GE(ties, 1900);  // the tie cases were there to check (2000 drawn, NaN patterns dropped)
  EXPECT_GT(rounded_up, 0);
}

TEST(MasterSplit, NanStaysNan) {
  for (uint32_t u : {0x7fc00000u, 0x7fffffffu, 0xffffffffu, 0x7f800001u, 0xff80ffffu}) {
    uint16_t high;
    int16_t remainder;
    ops::split_master_value(bits_float(u), high, remainder);
    EXPECT_TRUE(std::isnan(bf16_bits_to_float(high))) << std::hex << u;  // the weight is NaN too, not zero
    EXPECT_TRUE(std::isnan(ops::join_master_value(high, remainder))) << std::hex << u;
    EXPECT_EQ(high >> 15, u >> 31) << "sign of " << std::hex << u;
  }
}

// Three steps (the second clipped) of AdamW on the halves against AdamW on the f32 master: the
// same per-element function, so the joined master and the moments agree bit for bit.
TEST(MasterSplit, AdamWOnTheHalvesIsAdamWOnTheMaster) {
  for (DType moments : {DType::F32, DType::BF16}) {
    const int64_t n = 10007;
    Tensor master = random_tensor({n}, DType::F32, Device::cpu(), -0.5, 0.5);
    Tensor m = random_tensor({n}, moments, Device::cpu(), -0.1, 0.1), v = random_tensor({n}, moments, Device::cpu(), 0.0, 0.01);
    Tensor m2 = m.clone(), v2 = v.clone();
    Tensor high = Tensor::empty({n}, DType::BF16), remainder = Tensor::empty({n}, DType::I16);
    ops::split_master(master, high, remainder);
    for (int64_t step = 1; step <= 3; ++step) {
      const Tensor g = random_tensor({n}, DType::F32, Device::cpu(), -3.0, 3.0);
      const ops::AdamWConfig c{1e-3, 0.9, 0.95, 1e-8, 0.1, step};
      const float clip = step == 2 ? 0.5f : 1.0f;
      ops::adamw_step(master, g, m, v, c, clip);
      ops::adamw_step_split(high, remainder, g, m2, v2, c, clip);
    }
    Tensor joined = Tensor::empty({n}, DType::F32);
    ops::join_master(high, remainder, joined);
    EXPECT_EQ(std::memcmp(joined.data_ptr(), master.data_ptr(), master.nbytes()), 0) << dtype_name(moments);
    EXPECT_EQ(std::memcmp(m.data_ptr(), m2.data_ptr(), m.nbytes()), 0) << dtype_name(moments);
    EXPECT_EQ(std::memcmp(v.data_ptr(), v2.data_ptr(), v.nbytes()), 0) << dtype_name(moments);
  }
}

TEST(MasterSplit, BadArgumentsAreNamed) {
  Tensor master = Tensor::zeros({4}, DType::F32), high = Tensor::zeros({4}, DType::BF16);
  Tensor remainder = Tensor::zeros({4}, DType::I16), wrong = Tensor::zeros({4}, DType::F32);
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { ops::split_master(master, wrong, remainder); }).find("'high' has dtype f32"), std::string::npos);
  EXPECT_NE(message([&] { ops::join_master(high, wrong, master); }).find("'remainder' has dtype f32"), std::string::npos);
  Tensor short_remainder = Tensor::zeros({3}, DType::I16);
  EXPECT_NE(message([&] { ops::join_master(high, short_remainder, master); }).find("remainder"), std::string::npos);
  Tensor g16 = Tensor::zeros({4}, DType::BF16), m = Tensor::zeros({4}, DType::F32), v = m.clone();
  EXPECT_NE(message([&] { ops::adamw_step_split(high, remainder, g16, m, v, {1e-3, 0.9, 0.95, 1e-8, 0.0, 1}); })
                .find("'grad' has dtype bf16; expected f32"),
            std::string::npos);
  ParamStore f32_store(Device::cpu(), DType::F32, DType::F32, 1);
  EXPECT_NE(message([&] { f32_store.store_param_remainders(true); }).find("need bf16 compute with f32 masters"),
            std::string::npos);
}

// Two stores drawn from one seed, one with split masters: the same masters after initialisation
// and after three optimizer steps on the same gradients; the fp32-compute (router-like) weight is
// its joined master; the checkpoint tensors agree bit for bit, and load() restores the halves.
TEST(MasterSplit, StoreWithSplitMastersStepsLikeWholeMasters) {
  auto make = [](bool split) {
    auto store = std::make_unique<ParamStore>(Device::cpu(), DType::F32, DType::BF16, 7);
    store->add("decoder.layers.0.linear.weight", {37, 29}, Init::Normal, 0.5, true);
    store->add("decoder.layers.0.norm.weight", {29}, Init::Ones, 0.0, false);
    store->add("decoder.layers.0.router.weight", {4, 29}, Init::Normal, 0.5, true, DType::F32, false);
    store->add_buffer("decoder.layers.0.router.expert_bias", {4});
    store->store_param_remainders(split);
    store->initialize();
    return store;
  };
  auto whole = make(false), split = make(true);
  EXPECT_EQ(split->master_buffer().numel(), 0);  // no fp32 master buffer: the halves replace it
  EXPECT_EQ(split->remainder_buffer(false).dtype(), DType::I16);
  auto expect_same_masters = [&](const std::string& when) {
    for (size_t i = 0; i < whole->all().size(); ++i) {
      const Param& a = *whole->all()[i];
      const Param& b = *split->all()[i];
      const Tensor ma = whole->master_value(a), mb = split->master_value(b);
      EXPECT_EQ(std::memcmp(ma.data_ptr(), mb.data_ptr(), ma.nbytes()), 0) << a.name << " " << when;
      if (b.compute_dtype == DType::F32) EXPECT_EQ(to_doubles(b.weight), to_doubles(mb)) << b.name << " " << when;
      if (b.compute_dtype == DType::BF16) EXPECT_EQ(b.weight.data_ptr(), b.high.data_ptr()) << b.name;
    }
  };
  expect_same_masters("after initialize");
  Optimizer opt_whole(*whole, {}, false), opt_split(*split, {}, false);
  for (int64_t step = 1; step <= 3; ++step) {
    for (size_t i = 0; i < whole->all().size(); ++i) {
      Param& a = *whole->all()[i];
      if (!a.trainable) continue;
      const Tensor g = random_tensor(a.shape, DType::F32, Device::cpu(), -1.0, 1.0);
      a.grad.copy_from(g);
      split->all()[i]->grad.copy_from(g);
    }
    opt_whole.step({0.9, 0.95, 1e-8, 0.1}, 1e-2, step == 2 ? 0.5f : 1.0f, step);
    opt_split.step({0.9, 0.95, 1e-8, 0.1}, 1e-2, step == 2 ? 0.5f : 1.0f, step);
    expect_same_masters("after step " + std::to_string(step));
  }
  EXPECT_NEAR(opt_split.params_norm_sq(), opt_whole.params_norm_sq(), 1e-6 * opt_whole.params_norm_sq());
  const std::vector<NamedTensor> a = opt_whole.full_state(), b = opt_split.full_state();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].tensor.dtype(), DType::F32) << a[i].name;
    EXPECT_EQ(std::memcmp(a[i].tensor.data_ptr(), b[i].tensor.data_ptr(), a[i].tensor.nbytes()), 0) << a[i].name;
  }
  // A fresh split store loads the whole store's state: the same halves as the stepped one.
  auto loaded = make(true);
  Optimizer opt_loaded(*loaded, {}, false);
  opt_loaded.load([&](const std::string& name, const Shape&, DType) {
    for (const NamedTensor& t : a)
      if (t.name == name) return t.tensor;
    ADD_FAILURE() << "no " << name;
    return Tensor();
  }, false);
  for (size_t i = 0; i < loaded->all().size(); ++i) {
    const Param& p = *loaded->all()[i];
    const Param& q = *split->all()[i];
    if (!p.trainable) continue;
    EXPECT_EQ(to_doubles(p.high), to_doubles(q.high)) << p.name;
    EXPECT_EQ(std::memcmp(p.remainder.data_ptr(), q.remainder.data_ptr(), p.remainder.nbytes()), 0) << p.name;
    EXPECT_EQ(to_doubles(p.weight), to_doubles(q.weight)) << p.name;
  }
}
