// y = x @ W.T (+ bias) (+ residual) for bf16 x [M, K] and W packed by `pack` into pairs of K for 16 output columns:
// Wp[nb, kp, j, t] = W[16 nb + j, 2 kp + t], int32-viewed as [N/16, K/2, 16]. One VDPBF16PS then adds
// x[m, 2kp] W[., 2kp] + x[m, 2kp+1] W[., 2kp+1] into 16 columns' fp32 sums at once: the weight is read
// once, in order, whatever M is, and no horizontal sum is needed.
// Built by actors/cpu_kernels.py with -mavx512bf16; called only where the CPU has it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kCols = 16;  // output columns per block: one zmm of fp32 sums

// NB column blocks x MB input rows: NB * MB accumulators, each weight vector reused MB times.
template <int NB, int MB>
inline void tile(const at::BFloat16* x, int64_t K, const int32_t* w, int64_t Kp, const at::BFloat16* bias,
                 const at::BFloat16* residual, at::BFloat16* y, int64_t N, int64_t nb0, int64_t rows) {
  __m512 acc[NB][MB];
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[b][m] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < Kp; ++kp) {
    // The NB weight vectors held, each row's pair broadcast as it is used (VDPBF16PS's embedded broadcast): NB * MB
    // sums, NB weights and one broadcast in registers, so NB = 3 fits eight rows (28 of the 32).
    __m512i wv[NB];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + ((nb0 + b) * Kp + kp) * kCols);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      // Rows past `rows` repeat the last one; their sums are not stored.
      const int64_t row = m < rows ? m : rows - 1;
      const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + row * K + 2 * kp));
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) acc[b][m] = _mm512_dpbf16_ps(acc[b][m], (__m512bh)wv[b], (__m512bh)xb);
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b) {
    const int64_t col = (nb0 + b) * kCols;
    const __mmask16 mask = col + kCols <= N ? 0xFFFF : (__mmask16)((1u << (N - col)) - 1);
    // The bias is added in fp32, before the one rounding to bf16.
    const __m512 b16 = bias == nullptr ? _mm512_setzero_ps()
        : _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bias + col));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      if (m < rows) {  // RNE to bf16, as torch's own float -> bfloat16 conversion
        __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[b][m], b16));
        if (residual != nullptr) {  // residual + the rounded product, rounded again: torch's bf16 add of the two
          const __m512 r = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, residual + m * N + col));
          out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_cvtpbh_ps((__m256bh)out), r));
        }
        _mm256_mask_storeu_epi16(y + m * N + col, mask, out);
      }
    }
  }
}

template <int NB, int MB>
void blocks(const at::BFloat16* x, int64_t M, int64_t K, const int32_t* w, const at::BFloat16* bias,
            const at::BFloat16* residual, at::BFloat16* y, int64_t N, int64_t nb_begin, int64_t nb_end) {
  const int64_t Kp = K / 2;
  for (int64_t nb = nb_begin; nb < nb_end; nb += NB) {
    const int64_t nbs = std::min<int64_t>(NB, nb_end - nb);
    for (int64_t m0 = 0; m0 < M; m0 += MB) {  // further rows re-read this tile's weights from cache
      const int64_t rows = std::min<int64_t>(MB, M - m0);
      const at::BFloat16* res = residual == nullptr ? nullptr : residual + m0 * N;
      if (nbs == NB) {
        tile<NB, MB>(x + m0 * K, K, w, Kp, bias, res, y + m0 * N, N, nb, rows);
      } else {
        for (int64_t b = 0; b < nbs; ++b) tile<1, MB>(x + m0 * K, K, w, Kp, bias, res, y + m0 * N, N, nb + b, rows);
      }
    }
  }
}

}  // namespace

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                          const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.size(2) == kCols,
              "packed: int32 [N/16, K/2, 16]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(K == 2 * packed.size(1) && (N + kCols - 1) / kCols == NB, "shapes do not match");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous()),
              "bias: contiguous bf16 [N]");
  TORCH_CHECK(!residual.has_value() || (residual->scalar_type() == at::kBFloat16 && residual->is_contiguous() &&
                                        residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N),
              "residual: contiguous bf16 [M, N]");
  const auto* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  const auto* rp = residual.has_value() ? residual->data_ptr<at::BFloat16>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<int32_t>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) {
    if (M == 1) {
      blocks<4, 1>(xp, M, K, wp, bp, rp, yp, N, b0, b1);
    } else if (M <= 4) {
      blocks<4, 4>(xp, M, K, wp, bp, rp, yp, N, b0, b1);
    } else {  // 3 x 8: 24 sums per 3 weight loads (2 x 8 did 16 per 2; batch 8 steps: benchmarks/results/batch.md)
      blocks<3, 8>(xp, M, K, wp, bp, rp, yp, N, b0, b1);
    }
  });
  return y;
}
