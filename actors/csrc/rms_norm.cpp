// RMSNorm of bf16 rows as HF computes it for a bf16 model: normalised in fp32, rounded to bf16, then scaled
// by the bf16 weight and rounded again. One pass over each row instead of torch's five ops (float(), the
// fused norm, to(), the multiply and their allocations), which cost ~25 µs a call at decode's few rows.
// x: [..., K] bf16, contiguous; w: [K] bf16. Built with -mavx512bf16 by actors/cpu_kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

#include "vec_math.h"

using vec_math::load16;
using vec_math::round_bf16;
using vec_math::tail;

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() >= 1, "x: contiguous bf16 [..., K]");
  const int64_t K = x.size(-1), M = K == 0 ? 0 : x.numel() / K;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == K, "w: contiguous bf16 [K]");
  auto y = torch::empty_like(x);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {  // decode's few rows: one thread, no fork
    for (int64_t m = m0; m < m1; ++m) {
      const at::BFloat16* row = xp + m * K;
      __m512 sq = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = load16(row + k, tail(k, K));
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sq) / (float)K + (float)eps));
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = tail(k, K);
        const __m512 normed = round_bf16(_mm512_mul_ps(load16(row + k, mask), r));
        _mm256_mask_storeu_epi16(yp + m * K + k, mask,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(normed, load16(wp + k, mask))));
      }
    }
  });
  return y;
}
