// The MLP's activation on its joined gate and up projections: silu(gate) * up in one pass, as torch computes
// F.silu(gate, inplace=True).mul_(up) on bf16 (each result in fp32, rounded to bf16: silu first, then the
// product), into a new contiguous tensor, in fewer µs than torch's two ops and the copy that makes the down
// projection's input contiguous (benchmarks/results/batch.md's kernel table: 8 rows and a 256-token prompt
// chunk of the demo model's MLP). The same bits as torch's but for products below fp32's normal range (~1e-38),
// which the conversion instruction flushes to 0 where torch keeps them (tests/runtime/test_silu_mul.py).
// gate_up: [M, 2I] bf16, contiguous, gate then up; returns [M, I]. Built with -mavx512bf16 by actors/cpu_kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vec_math.h"

using vec_math::load16;
using vec_math::round_bf16;
using vec_math::tail;

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() &&
              gate_up.size(1) % 2 == 0, "gate_up: contiguous bf16 [M, 2I]");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto y = torch::empty({M, I}, gate_up.options());
  const auto* gp = gate_up.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {  // decode's few rows: one thread, no fork
    for (int64_t m = m0; m < m1; ++m) {
      const at::BFloat16* gate = gp + m * 2 * I;
      const at::BFloat16* up = gate + I;
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 mask = tail(i, I);
        const __m512 g = load16(gate + i, mask);
        // silu(g) = g / (1 + exp(-g)), as torch's kernel computes it in fp32
        const __m512 e = vec_math::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        _mm256_mask_storeu_epi16(yp + m * I + i, mask,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, load16(up + i, mask))));
      }
    }
  });
  return y;
}
