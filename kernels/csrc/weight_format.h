// The weight formats the kernels stream, in one table (as ggml's type traits): each format's dtype,
// the bytes a row carries past its values, whether a row scale comes with it as a tensor of its own,
// and which kernels take it. The checks of dense_linear, the LM head, fused_moe and DecodeLayers read
// it, and so does the Python side (weight_formats(), kernels/cpu_moe.py).
#pragma once

#include <torch/extension.h>

#include <string>

namespace moebench_cpu {

// int8 rows that carry their scale (--weights int8, engine/quantize.py pack_int8_rows): a row of K
// values, its float32 scale, 4 bytes of padding.
constexpr int64_t kPackedExtra = 8;

enum WeightUse : unsigned { kDenseWeights = 1u, kExpertWeights = 2u, kLmHeadWeights = 4u };

struct WeightFormat {
  c10::ScalarType dtype;
  const char* name;
  const char* layout;  // how a row is laid out, for messages and the Python side
  int64_t row_extra;   // bytes a row carries past its values
  bool scale_tensor;   // a float32 scale per row comes as a tensor of its own
  unsigned uses;       // WeightUse bits
};

inline constexpr WeightFormat kWeightFormats[] = {
    {c10::ScalarType::Float, "float32", "values", 0, false, kDenseWeights | kExpertWeights | kLmHeadWeights},
    {c10::ScalarType::BFloat16, "bfloat16", "values, widened in registers", 0, false,
     kDenseWeights | kExpertWeights | kLmHeadWeights},
    {c10::ScalarType::Char, "int8", "values, then the row's float32 scale and 4 bytes of padding", kPackedExtra,
     false, kDenseWeights | kExpertWeights},
    {c10::ScalarType::Char, "int8", "values, times a row scale", 0, true, kLmHeadWeights},
    {c10::ScalarType::Float8_e4m3fn, "float8_e4m3fn", "values, times a row scale", 0, true, kLmHeadWeights},
};

// The dtypes the kernels' counters are kept by (weight_stats, lm_head_stats), in this order.
inline constexpr c10::ScalarType kCountedDtypes[] = {c10::ScalarType::Float, c10::ScalarType::BFloat16,
                                                     c10::ScalarType::Char, c10::ScalarType::Float8_e4m3fn};
inline constexpr int kNumCountedDtypes = 4;

inline int counted_dtype_index(c10::ScalarType t) {
  for (int i = 0; i < kNumCountedDtypes; ++i)
    if (kCountedDtypes[i] == t) return i;
  return -1;
}

inline const char* counted_dtype_name(int i) {
  for (const WeightFormat& f : kWeightFormats)
    if (f.dtype == kCountedDtypes[i]) return f.name;
  return "?";
}

// The format `use` takes in dtype `t`, or null.
inline const WeightFormat* weight_format(c10::ScalarType t, WeightUse use) {
  for (const WeightFormat& f : kWeightFormats)
    if (f.dtype == t && (f.uses & use)) return &f;
  return nullptr;
}

// Whether w is int8 rows carrying their scale for K input columns ([M, K + kPackedExtra], rows contiguous).
inline bool packed_int8(const torch::Tensor& w, int64_t K) {
  return w.scalar_type() == torch::kChar && w.dim() >= 2 && w.size(-1) == K + kPackedExtra &&
         w.stride(-1) == 1 && w.stride(-2) % 4 == 0 && K % 4 == 0;  // the scales are aligned floats
}

// Whether `use` takes w (2-D or more) as rows of K input columns: a format of its dtype, rows
// contiguous, each K values plus the format's extra bytes (aligned, for rows carrying their scale).
inline bool takes_rows(const torch::Tensor& w, int64_t K, WeightUse use) {
  const WeightFormat* f = weight_format(w.scalar_type(), use);
  if (f == nullptr || w.dim() < 2 || w.stride(-1) != 1) return false;
  return f->row_extra ? packed_int8(w, K) : w.size(-1) == K;
}

// The formats `use` takes, in words (the checks' messages).
inline std::string accepted_formats(WeightUse use) {
  std::string out;
  for (const WeightFormat& f : kWeightFormats)
    if (f.uses & use) out += (out.empty() ? "" : "; ") + std::string(f.name) + " (" + f.layout + ")";
  return out;
}

}  // namespace moebench_cpu
