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
  // Rows stored in blocks (as ggml's blck_size and type_size): a block of block_values values takes
  // block_bytes bytes (int4: 32 values in 18, Q4_0's; int4_cpu.h). 1 and 0: a value per element.
  int64_t block_values = 1;
  int64_t block_bytes = 0;
  const char* torch_dtype = nullptr;  // the torch dtype holding the rows, where it is not `name` (int4: uint8)
};

inline constexpr WeightFormat kWeightFormats[] = {
    {c10::ScalarType::Float, "float32", "values", 0, false, kDenseWeights | kExpertWeights | kLmHeadWeights},
    {c10::ScalarType::BFloat16, "bfloat16", "values, widened in registers", 0, false,
     kDenseWeights | kExpertWeights | kLmHeadWeights},
    {c10::ScalarType::Char, "int8", "values, then the row's float32 scale and 4 bytes of padding", kPackedExtra,
     false, kDenseWeights | kExpertWeights},
    {c10::ScalarType::Char, "int8", "values, times a row scale", 0, true, kLmHeadWeights},
    {c10::ScalarType::Float8_e4m3fn, "float8_e4m3fn", "values, times a row scale", 0, true, kLmHeadWeights},
    {c10::ScalarType::Byte, "int4", "Q4_0 blocks of 32 values: a float16 scale, then 16 bytes of 4-bit values + 8",
     0, false, kDenseWeights | kExpertWeights, 32, 18, "uint8"},
};

// The dtypes the kernels' counters are kept by (weight_stats, lm_head_stats), in this order.
inline constexpr c10::ScalarType kCountedDtypes[] = {c10::ScalarType::Float, c10::ScalarType::BFloat16,
                                                     c10::ScalarType::Char, c10::ScalarType::Float8_e4m3fn,
                                                     c10::ScalarType::Byte};
inline constexpr int kNumCountedDtypes = 5;

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

// The stored width of a row of K values in format f (elements of its dtype), and the K of a stored width.
inline int64_t stored_width(const WeightFormat& f, int64_t K) {
  return f.block_values > 1 ? K / f.block_values * f.block_bytes : K + f.row_extra;
}
inline int64_t input_width(const WeightFormat& f, int64_t width) {
  return f.block_values > 1 ? width / f.block_bytes * f.block_values : width - f.row_extra;
}

// Whether `use` takes w (2-D or more) as rows of K input columns: a format of its dtype, rows
// contiguous, each K values plus the format's extra bytes (aligned, for rows carrying their scale),
// or whole blocks of a blocked format.
inline bool takes_rows(const torch::Tensor& w, int64_t K, WeightUse use) {
  const WeightFormat* f = weight_format(w.scalar_type(), use);
  if (f == nullptr || w.dim() < 2 || w.stride(-1) != 1) return false;
  if (f->block_values > 1) return K % f->block_values == 0 && w.size(-1) == stored_width(*f, K);
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
