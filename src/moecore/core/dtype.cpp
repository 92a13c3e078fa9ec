#include "moecore/core/dtype.h"

#include "moecore/core/error.h"

namespace moecore {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::FP8E4M3: return 1;
    case DType::FP8E5M2: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::I16: return 2;
  }
  MC_FAIL("unknown dtype code ", static_cast<int>(t));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::BF16: return "bf16";
    case DType::FP8E4M3: return "fp8e4m3";
    case DType::FP8E5M2: return "fp8e5m2";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::I16: return "i16";
  }
  return "?";
}

DType parse_dtype(std::string_view n) {
  if (n == "f32" || n == "fp32" || n == "float32" || n == "float") return DType::F32;
  if (n == "f64" || n == "fp64" || n == "float64" || n == "double") return DType::F64;
  if (n == "bf16" || n == "bfloat16") return DType::BF16;
  if (n == "fp8e4m3" || n == "e4m3") return DType::FP8E4M3;
  if (n == "fp8e5m2" || n == "e5m2") return DType::FP8E5M2;
  if (n == "i32" || n == "int32") return DType::I32;
  if (n == "i64" || n == "int64") return DType::I64;
  if (n == "u8" || n == "uint8") return DType::U8;
  if (n == "i16" || n == "int16") return DType::I16;
  MC_FAIL("unknown dtype '", n, "': expected one of f32, f64, bf16, fp8e4m3, fp8e5m2, i32, i64, u8, i16");
}

bool is_floating(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::BF16 || t == DType::FP8E4M3 ||
         t == DType::FP8E5M2;
}

}  // namespace moecore
