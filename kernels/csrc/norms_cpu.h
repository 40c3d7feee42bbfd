// The sums in torch's order and the RMSNorm steps that the extension's decode-step ops share
// (defined in norms_cpu.cpp): decode_attention_block's q/k RMSNorm (attention_cpu.cpp), and the
// router's renormalization and routing summary (routing_cpu.cpp).
#pragma once

#include <cstdint>

namespace moebench_cpu {

// A sum of n floats, in one of the orders torch's CPU sum takes.
using SumFn = float (*)(const float*, int64_t);

// The torch-order sum that reproduces torch's x.sum(-1) over the rows of an [N, k] float32 tensor,
// or nullptr when no candidate order does (torch must then sum). Calibrated once per (k, N).
SumFn calibrated_row_sum(int64_t k, int64_t N);

// torch's float32 mean of x[0:n], as a contiguous tensor's mean() gives it.
float mean_torch_order(const float* x, int64_t n);

// Mean of squares of each of R rows of x (row r at x + r * ld, D values): as torch's
// x.pow(2).mean(-1) gives it, into out[R].
void mean_of_squares(const float* x, int64_t R, int64_t D, int64_t ld, float* out);

// out = (x * (1 / sqrt(ms + eps))) * w for one row of D values whose mean of squares is ms:
// F.rms_norm's float32 steps, rounded as torch rounds them.
void normalize_row(const float* x, float ms, float eps, const float* w, float* out, int64_t D);

}  // namespace moebench_cpu
