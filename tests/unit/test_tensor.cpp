#include <gtest/gtest.h>

#include "moecore/core/allocator.h"
#include "moecore/core/tensor.h"

using namespace moecore;

namespace {
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}
}  // namespace

TEST(Tensor, CreateAndReadBack) {
  Tensor t = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(t.ndim(), 2);
  EXPECT_EQ(t.size(-1), 3);
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.nbytes(), 24u);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.describe(), "Tensor(f32, cpu, (2, 3))");
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  Tensor z = Tensor::zeros({3}, DType::I64);
  EXPECT_EQ(z.to_vector<int64_t>(), (std::vector<int64_t>{0, 0, 0}));
  Tensor empty = Tensor::empty({0, 5}, DType::BF16);
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_TRUE(empty.to_vector<bf16>().empty());
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = Tensor::from_vector<int32_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4});
  Tensor v = t.view({2, -1});
  EXPECT_EQ(v.shape(), (Shape{2, 6}));
  v.data<int32_t>()[0] = 42;
  EXPECT_EQ(t.to_vector<int32_t>()[0], 42);
  Tensor rows = t.slice(0, 1, 3);
  EXPECT_TRUE(rows.is_contiguous());
  EXPECT_EQ(rows.to_vector<int32_t>(), (std::vector<int32_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  Tensor cols = t.slice(1, 1, 3);
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_EQ(cols.contiguous().to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 5, 6, 9, 10}));
  Tensor tr = t.transpose(0, 1);
  EXPECT_EQ(tr.shape(), (Shape{4, 3}));
  EXPECT_EQ(tr.contiguous().to_vector<int32_t>(), (std::vector<int32_t>{42, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
}

TEST(Tensor, CopiesAreIndependent) {
  Tensor t = Tensor::from_vector<double>({1, 2, 3}, {3});
  Tensor c = t.clone();
  c.data<double>()[1] = -1;
  EXPECT_EQ(t.to_vector<double>()[1], 2.0);
  Tensor strided_dst = Tensor::zeros({3, 2}, DType::F64).slice(1, 0, 1);  // a column
  strided_dst.copy_from(t.view({3, 1}));
  EXPECT_EQ(strided_dst.contiguous().to_vector<double>(), (std::vector<double>{1, 2, 3}));
}

TEST(Tensor, MisuseGivesClearErrors) {
  Tensor t = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_EQ(message_of([&] { t.view({4, 2}); }), "view: shape (4, 2) has 8 elements, tensor has 6");
  EXPECT_EQ(message_of([&] { t.slice(1, 2, 5); }), "slice: [2, 5) out of range for dimension 1 of Tensor(f32, cpu, (2, 3))");
  EXPECT_EQ(message_of([&] { t.data<double>(); }), "tensor Tensor(f32, cpu, (2, 3)) accessed as f64");
  EXPECT_EQ(message_of([&] { t.transpose(0, 1).view({6}); }),
            "view of a non-contiguous tensor Tensor(f32, cpu, (3, 2)): call contiguous() first");
  Tensor other = Tensor::zeros({3, 2}, DType::F32);
  EXPECT_EQ(message_of([&] { other.copy_from(t); }), "copy_from: shape (2, 3) into (3, 2)");
  EXPECT_EQ(message_of([&] { Tensor::empty({-1}, DType::F32); }), "negative dimension in shape (-1)");
  EXPECT_EQ(message_of([&] { Tensor().data_ptr(); }), "use of an undefined tensor");
}

TEST(Tensor, CudaWithoutADeviceSaysWhy) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present; the GPU tier covers it";
  const std::string msg = message_of([] { Tensor::empty({4}, DType::F32, Device::cuda(0)); });
  EXPECT_NE(msg.find("CUDA memory requested but"), std::string::npos) << msg;
  const std::string dev = message_of([] { parse_device("cuda:1"); });
  EXPECT_NE(dev.find("device 'cuda:1' is not available"), std::string::npos) << dev;
}

TEST(Device, ParseAndPrint) {
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(Device::cuda(3).str(), "cuda:3");
  EXPECT_EQ(message_of([] { parse_device("tpu"); }), "bad device 'tpu': expected cpu, cuda or cuda:N");
  EXPECT_EQ(message_of([] { parse_device("cuda:x"); }), "bad device 'cuda:x': expected cpu, cuda or cuda:N");
}

TEST(Device, CpuEventsMeasureHostTime) {
  Event a, b;
  a.record();
  volatile double s = 0;
  for (int i = 0; i < 100000; ++i) s = s + i;
  b.record();
  EXPECT_GE(b.elapsed_ms_since(a), 0.0f);
}

TEST(Allocator, CpuStatisticsTrackLiveBytes) {
  CachingAllocator& a = cpu_allocator();
  const AllocatorStats before = a.stats();
  {
    Tensor t = Tensor::empty({1000}, DType::F64);  // 8000 bytes -> rounded to 8192
    EXPECT_EQ(a.stats().allocated_bytes - before.allocated_bytes, 8192);
  }
  EXPECT_EQ(a.stats().allocated_bytes, before.allocated_bytes);
}
