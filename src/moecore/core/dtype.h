// Element types. f64 exists for CPU gradient checks; bf16 and the fp8 formats are stored as
// bit containers (float_formats.h) and computed in fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "moecore/core/float_formats.h"

namespace moecore {

enum class DType : uint8_t { F32, F64, BF16, FP8E4M3, FP8E5M2, I32, I64, U8, I16 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "f32", "bf16", "fp8e4m3", ...
// Accepts the names above and common aliases ("float32", "bfloat16", "e4m3", ...).
DType parse_dtype(std::string_view name);
bool is_floating(DType t);

template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::F32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::F64; };
template <> struct DTypeOf<bf16> { static constexpr DType value = DType::BF16; };
template <> struct DTypeOf<fp8e4m3> { static constexpr DType value = DType::FP8E4M3; };
template <> struct DTypeOf<fp8e5m2> { static constexpr DType value = DType::FP8E5M2; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::I32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::I64; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::U8; };
template <> struct DTypeOf<int16_t> { static constexpr DType value = DType::I16; };
template <typename T> inline constexpr DType dtype_of = DTypeOf<T>::value;

}  // namespace moecore
