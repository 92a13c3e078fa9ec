// Tensor: shape, dtype, device and a view (offset + strides) into shared storage.
//
// Storage is one contiguous allocation from the device's caching allocator, freed when the
// last tensor viewing it goes away. A tensor is a cheap handle: copying it shares storage.
// Views (view, slice, transpose) share storage; clone() and contiguous() copy. Ops take
// their outputs as arguments, allocated by the caller (llm.c style), and require contiguous
// tensors unless they say otherwise.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/core/dtype.h"
#include "moecore/core/error.h"

namespace moecore {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "(2, 3)"
int64_t shape_numel(const Shape& s);

class CachingAllocator;

struct Storage {
  Storage(size_t nbytes, Device device, bool pinned);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data = nullptr;
  size_t nbytes = 0;
  Device device;
  bool pinned = false;
  CachingAllocator* allocator = nullptr;
};

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Host memory that the GPU can copy from/to asynchronously (without a CUDA device: plain host
  // memory of a separate allocator, core/allocator.h).
  static Tensor empty_pinned(const Shape& shape, DType dtype);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }  // in elements
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int dim) const;  // negative dims count from the end
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::cpu(); }
  bool is_pinned() const { return storage_ && storage_->pinned; }
  bool is_contiguous() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  int64_t offset() const { return offset_; }

  void* data_ptr() const;
  // Typed pointer; raises if T does not match the dtype.
  template <typename T>
  T* data() const {
    MC_CHECK(dtype_of<T> == dtype_, "tensor ", describe(), " accessed as ", dtype_name(dtype_of<T>));
    return static_cast<T*>(data_ptr());
  }

  // ---- views (share storage) ----
  // Same elements, new shape; one dim may be -1. Needs a contiguous tensor.
  Tensor view(const Shape& shape) const;
  // Elements [start, end) along `dim`.
  Tensor slice(int dim, int64_t start, int64_t end) const;
  Tensor transpose(int dim0, int dim1) const;

  // ---- copies ----
  Tensor contiguous() const;  // this tensor if already contiguous, else a compact copy
  Tensor clone() const;
  Tensor to(Device device) const;  // a copy on `device` (this tensor if already there)
  // Copies src's elements into this tensor: same shape and dtype, any devices; if both are
  // on the CPU any strides work, otherwise both must be contiguous. Asynchronous on the
  // current stream when a CUDA device is involved, except that copies to pageable host
  // memory complete before returning.
  void copy_from(const Tensor& src);
  template <typename T>
  std::vector<T> to_vector() const;  // host copy of the elements in row-major order

  std::string describe() const;  // "Tensor(f32, cuda:0, (4, 8))"

  // ---- released bytes (selective recomputation of a tensor other modules also saved) ----
  // release_storage frees the bytes of this tensor's storage: every tensor sharing it keeps its
  // shape but has no data until reacquire_storage gets new bytes (charged to the current memory
  // category) for all of them; the caller then rewrites the values.
  void release_storage();
  void reacquire_storage();
  bool storage_released() const { return storage_ && !storage_->data; }

 private:
  std::shared_ptr<Storage> storage_;
  Shape shape_;
  Shape strides_;
  int64_t offset_ = 0;  // in elements
  DType dtype_ = DType::F32;
};

Shape contiguous_strides(const Shape& shape);

}  // namespace moecore
