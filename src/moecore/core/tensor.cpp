#include "moecore/core/tensor.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "moecore/core/allocator.h"

#if MOECORE_WITH_CUDA
#include "moecore/core/cuda_check.h"
#endif

namespace moecore {

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ")";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = acc;
    acc *= shape[i];
  }
  return st;
}

Storage::Storage(size_t n, Device d, bool pin) : nbytes(n), device(d), pinned(pin) {
  allocator = &allocator_for(d, pin);
  void* stream = d.is_cuda() ? current_stream(d).handle() : nullptr;
  data = allocator->allocate(n, stream);
}

Storage::~Storage() {
  if (data) allocator->deallocate(data);
}

void Tensor::release_storage() {
  MC_CHECK(storage_ && storage_->data, "release_storage of ", storage_ ? "a released" : "an undefined", " tensor");
  storage_->allocator->deallocate(storage_->data);
  storage_->data = nullptr;
}

void Tensor::reacquire_storage() {
  MC_CHECK(storage_released(), "reacquire_storage of a tensor whose bytes were not released: ", describe());
  Storage& st = *storage_;
  st.data = st.allocator->allocate(st.nbytes, st.device.is_cuda() ? current_stream(st.device).handle() : nullptr);
}

static void check_shape(const Shape& shape) {
  for (int64_t d : shape) MC_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  check_shape(shape);
  Tensor t;
  t.storage_ = std::make_shared<Storage>(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), device, false);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::empty_pinned(const Shape& shape, DType dtype) {
  check_shape(shape);
  Tensor t;
  t.storage_ = std::make_shared<Storage>(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), Device::cpu(), true);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  if (device.is_cpu()) {
    std::memset(t.data_ptr(), 0, t.nbytes());
  } else {
#if MOECORE_WITH_CUDA
    MC_CUDA_CHECK(cudaSetDevice(device.index));
    MC_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), static_cast<cudaStream_t>(current_stream(device).handle())));
#endif
  }
  return t;
}

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  MC_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), "from_vector: ", values.size(),
           " values for shape ", shape_str(shape));
  Tensor host = empty(shape, dtype_of<T>, Device::cpu());
  if (!values.empty()) std::memcpy(host.data_ptr(), values.data(), values.size() * sizeof(T));
  return host.to(device);
}

int64_t Tensor::size(int dim) const {
  const int d = dim < 0 ? dim + ndim() : dim;
  MC_CHECK(d >= 0 && d < ndim(), "dimension ", dim, " out of range for ", describe());
  return shape_[static_cast<size_t>(d)];
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  MC_CHECK(storage_, "use of an undefined tensor");
  MC_CHECK(storage_->data || storage_->nbytes == 0, "use of a tensor whose bytes were released (release_storage)");
  return static_cast<char*>(storage_->data) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::view(const Shape& shape) const {
  MC_CHECK(is_contiguous(), "view of a non-contiguous tensor ", describe(), ": call contiguous() first");
  Shape s = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      MC_CHECK(infer < 0, "view: more than one -1 in ", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      MC_CHECK(s[i] >= 0, "view: negative dimension in ", shape_str(shape));
      known *= s[i];
    }
  }
  if (infer >= 0) {
    MC_CHECK(known > 0 && numel() % known == 0, "view: cannot infer -1 in ", shape_str(shape), " for ", numel(),
             " elements");
    s[static_cast<size_t>(infer)] = numel() / known;
  }
  MC_CHECK(shape_numel(s) == numel(), "view: shape ", shape_str(s), " has ", shape_numel(s),
           " elements, tensor has ", numel());
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::slice(int dim, int64_t start, int64_t end) const {
  const int d = dim < 0 ? dim + ndim() : dim;
  MC_CHECK(d >= 0 && d < ndim(), "slice: dimension ", dim, " out of range for ", describe());
  MC_CHECK(0 <= start && start <= end && end <= shape_[static_cast<size_t>(d)], "slice: [", start, ", ", end,
           ") out of range for dimension ", d, " of ", describe());
  Tensor t = *this;
  t.offset_ += start * strides_[static_cast<size_t>(d)];
  t.shape_[static_cast<size_t>(d)] = end - start;
  return t;
}

Tensor Tensor::transpose(int dim0, int dim1) const {
  const int a = dim0 < 0 ? dim0 + ndim() : dim0;
  const int b = dim1 < 0 ? dim1 + ndim() : dim1;
  MC_CHECK(a >= 0 && a < ndim() && b >= 0 && b < ndim(), "transpose: dims ", dim0, ", ", dim1, " out of range for ",
           describe());
  Tensor t = *this;
  std::swap(t.shape_[static_cast<size_t>(a)], t.shape_[static_cast<size_t>(b)]);
  std::swap(t.strides_[static_cast<size_t>(a)], t.strides_[static_cast<size_t>(b)]);
  return t;
}

// Strided host copy, recursing over dimensions; the innermost contiguous run uses memcpy.
static void copy_strided_host(char* dst, const Shape& dst_strides, const char* src, const Shape& src_strides,
                              const Shape& shape, size_t elem, size_t dim) {
  if (dim == shape.size()) {
    std::memcpy(dst, src, elem);
    return;
  }
  const int64_t n = shape[dim];
  if (dim + 1 == shape.size() && dst_strides[dim] == 1 && src_strides[dim] == 1) {
    std::memcpy(dst, src, static_cast<size_t>(n) * elem);
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    copy_strided_host(dst + i * dst_strides[dim] * static_cast<int64_t>(elem), dst_strides,
                      src + i * src_strides[dim] * static_cast<int64_t>(elem), src_strides, shape, elem, dim + 1);
}

// A layout of `rows` rows of `width` contiguous elements, `pitch` elements apart (ok = false when
// the tensor does not collapse into that form). Size-1 dimensions are ignored.
namespace {
struct Pitched {
  bool ok = false;
  int64_t rows = 1, width = 1, pitch = 1;
};
Pitched pitched(const Shape& shape, const Shape& strides) {
  Pitched p;
  size_t i = shape.size();
  int64_t expected = 1;
  // The contiguous innermost run.
  while (i > 0 && (shape[i - 1] == 1 || strides[i - 1] == expected)) {
    expected *= shape[i - 1];
    --i;
  }
  p.width = expected;
  // The remaining dimensions must form one evenly strided run of rows.
  int64_t rows = 1, stride = 0;
  for (size_t j = i; j-- > 0;) {
    if (shape[j] == 1) continue;
    if (rows == 1) {
      stride = strides[j];
    } else if (strides[j] != stride * rows) {
      return p;
    }
    rows *= shape[j];
  }
  p.rows = rows;
  p.pitch = rows == 1 ? p.width : stride;
  p.ok = p.pitch >= p.width;
  return p;
}
}  // namespace

void Tensor::copy_from(const Tensor& src) {
  MC_CHECK(defined() && src.defined(), "copy_from: undefined tensor");
  MC_CHECK(shape_ == src.shape_, "copy_from: shape ", shape_str(src.shape_), " into ", shape_str(shape_));
  MC_CHECK(dtype_ == src.dtype_, "copy_from: dtype ", dtype_name(src.dtype_), " into ", dtype_name(dtype_),
           " (use the cast op to convert)");
  if (numel() == 0) return;
  const Device dd = device(), sd = src.device();
  if (dd.is_cpu() && sd.is_cpu()) {
    copy_strided_host(static_cast<char*>(data_ptr()), strides_, static_cast<const char*>(src.data_ptr()),
                      src.strides_, shape_, dtype_size(dtype_), 0);
    return;
  }
#if MOECORE_WITH_CUDA
  const Device cuda_dev = dd.is_cuda() ? dd : sd;
  MC_CUDA_CHECK(cudaSetDevice(cuda_dev.index));
  cudaStream_t stream = static_cast<cudaStream_t>(current_stream(cuda_dev).handle());
  if (!is_contiguous() || !src.is_contiguous()) {
    // Row-pitched layouts on one device (a range of a middle dimension, e.g. a sequence slice of
    // [B, S, H, D]): one 2-D copy.
    Pitched d = pitched(shape_, strides_), s = pitched(src.shape_, src.strides_);
    if (is_contiguous()) d = {s.ok, s.rows, s.width, s.width};  // the other side's rows, packed
    if (src.is_contiguous()) s = {d.ok, d.rows, d.width, d.width};
    MC_CHECK(dd.is_cuda() && sd.is_cuda() && dd.index == sd.index && d.ok && s.ok && d.rows == s.rows &&
                 d.width == s.width,
             "copy_from between ", src.device().str(), " and ", device().str(),
             " needs contiguous tensors (or row-pitched ones on one device), got ", src.describe(), " into ",
             describe());
    const size_t es = dtype_size(dtype_);
    const size_t dp = static_cast<size_t>(d.pitch) * es, sp = static_cast<size_t>(s.pitch) * es;
    const size_t width = static_cast<size_t>(d.width) * es;
    if (std::max(dp, sp) < (size_t{1} << 31)) {  // cudaMemcpy2D's pitch limit (cudaDevAttrMaxPitch)
      MC_CUDA_CHECK(cudaMemcpy2DAsync(data_ptr(), dp, src.data_ptr(), sp, width, static_cast<size_t>(d.rows),
                                      cudaMemcpyDeviceToDevice, stream));
      return;
    }
    for (int64_t r = 0; r < d.rows; ++r)  // huge pitches: one copy per row
      MC_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(data_ptr()) + static_cast<size_t>(r) * dp,
                                    static_cast<const char*>(src.data_ptr()) + static_cast<size_t>(r) * sp, width,
                                    cudaMemcpyDeviceToDevice, stream));
    return;
  }
  if (dd.is_cuda() && sd.is_cuda() && dd.index != sd.index) {
    MC_CUDA_CHECK(cudaMemcpyPeerAsync(data_ptr(), dd.index, src.data_ptr(), sd.index, nbytes(), stream));
  } else {
    MC_CUDA_CHECK(cudaMemcpyAsync(data_ptr(), src.data_ptr(), nbytes(), cudaMemcpyDefault, stream));
  }
  // A host destination that is not pinned would be read right after we return.
  if (dd.is_cpu() && !is_pinned()) {
    count_host_synchronization();
    MC_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
#else
  MC_FAIL("copy between ", sd.str(), " and ", dd.str(), ": ", cuda_unavailable_reason());
#endif
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  MC_CHECK(device().is_cpu() || pitched(shape_, strides_).ok,
           "contiguous() of a CUDA tensor needs a row-pitched layout (e.g. a slice of one dimension), got ",
           describe());
  Tensor t = empty(shape_, dtype_, device());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_from(contiguous());
  return t;
}

Tensor Tensor::to(Device d) const {
  if (d == device()) return *this;
  Tensor t = empty(shape_, dtype_, d);
  t.copy_from(contiguous());
  return t;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  MC_CHECK(dtype_of<T> == dtype_, "to_vector<", dtype_name(dtype_of<T>), "> of ", describe());
  Tensor host = empty(shape_, dtype_, Device::cpu());
  host.copy_from(device().is_cpu() ? *this : contiguous());
  std::vector<T> out(static_cast<size_t>(numel()));
  if (!out.empty()) std::memcpy(out.data(), host.data_ptr(), out.size() * sizeof(T));
  return out;
}

std::string Tensor::describe() const {
  if (!defined()) return "Tensor(undefined)";
  return std::string("Tensor(") + dtype_name(dtype_) + ", " + device().str() + ", " + shape_str(shape_) + ")";
}

#define MC_INSTANTIATE(T)                                                                        \
  template Tensor Tensor::from_vector<T>(const std::vector<T>&, const Shape&, Device);          \
  template std::vector<T> Tensor::to_vector<T>() const;
MC_INSTANTIATE(float)
MC_INSTANTIATE(double)
MC_INSTANTIATE(bf16)
MC_INSTANTIATE(fp8e4m3)
MC_INSTANTIATE(fp8e5m2)
MC_INSTANTIATE(int32_t)
MC_INSTANTIATE(int64_t)
MC_INSTANTIATE(uint8_t)
MC_INSTANTIATE(int16_t)
#undef MC_INSTANTIATE

}  // namespace moecore
