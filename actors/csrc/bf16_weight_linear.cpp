// y = x @ W.T (+ bias) for fp32 x [M, K] and bf16 W [N, K] packed by bf16_weight_linear.pack: an fp32 model
// whose weights are bf16 values (a bf16 file widened on a CPU without bf16 arithmetic) reads half the bytes.
// Wp[nb, k, :] holds the 16 output columns 16 nb .. 16 nb + 15 of input feature k, in the order
//   c0 c1 c2 c3  c8 c9 c10 c11 | c4 c5 c6 c7  c12 c13 c14 c15   (two 128-bit lanes)
// so that VPUNPCKLWD / VPUNPCKHWD of zeros with one 256-bit load give columns 0..7 and 8..15 as fp32 (a bf16
// is the top half of its fp32): the weight is read once, in order, whatever M is, with no horizontal sum.
// Products and sums are fp32, exactly those of the widened weight, in another order than F.linear's: each output
// summed over k in order, one FMA at a time, whatever the tile, so a row's outputs do not depend on the others.
// Tiles of up to six rows serve prompt chunks too: with no register spilled they ran a 128-token chunk's
// products faster than MKL's GEMM over weights widened slice by slice (by hand, SmolLM2's 30 layers: 149 against
// 179 ms; 306 against 357 at 256 rows).
// Built with -mavx2 -mfma by actors/cpu_kernels.py; called only where the CPU has them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kCols = 16;  // output columns per block: two ymm of fp32 sums

// NB column blocks x MB input rows: 2 NB MB accumulators; each broadcast of x is reused by 2 NB FMAs. Every call
// has exactly MB rows: no branch in the loop, and no FMA spent on a row that is not there.
template <int NB, int MB>
inline void tile(const float* x, int64_t K, const int16_t* w, const float* bias, float* y, int64_t N, int64_t nb0) {
  __m256 lo[NB][MB], hi[NB][MB];
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) lo[b][m] = hi[b][m] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; ++k) {
    // Registers decide the order: with one block, its two weights stay while each row's broadcast is used at once
    // (six rows: 12 sums + 2 + 1 + 1 = 16 ymm; holding six broadcasts spilled five sums a k); with several blocks
    // and a row or two, the broadcasts stay while each block's weights are used at once.
    if constexpr (NB == 1) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (nb0 * K + k) * kCols));
      const __m256 wl = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wv));  // columns 0..7
      const __m256 wh = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wv));  // columns 8..15
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
        lo[0][m] = _mm256_fmadd_ps(wl, xb, lo[0][m]);
        hi[0][m] = _mm256_fmadd_ps(wh, xb, hi[0][m]);
      }
    } else {
      __m256 xb[MB];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) xb[m] = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ((nb0 + b) * K + k) * kCols));
        const __m256 wl = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wv));
        const __m256 wh = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wv));
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          lo[b][m] = _mm256_fmadd_ps(wl, xb[m], lo[b][m]);
          hi[b][m] = _mm256_fmadd_ps(wh, xb[m], hi[b][m]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b) {
    const int64_t col = (nb0 + b) * kCols;
    const int64_t width = std::min<int64_t>(kCols, N - col);
    alignas(32) float bias16[kCols] = {0};
    if (bias != nullptr)
      for (int64_t j = 0; j < width; ++j) bias16[j] = bias[col + j];
    const __m256 bl = _mm256_load_ps(bias16), bh = _mm256_load_ps(bias16 + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      float* out = y + m * N + col;
      if (width == kCols) {
        _mm256_storeu_ps(out, _mm256_add_ps(lo[b][m], bl));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(hi[b][m], bh));
      } else {  // the last block of an N that is not a multiple of 16: its padded columns are dropped
        alignas(32) float sums[kCols];
        _mm256_store_ps(sums, _mm256_add_ps(lo[b][m], bl));
        _mm256_store_ps(sums + 8, _mm256_add_ps(hi[b][m], bh));
        for (int64_t j = 0; j < width; ++j) out[j] = sums[j];
      }
    }
  }
}

template <int NB, int MB>
void blocks(const float* x, int64_t K, const int16_t* w, const float* bias, float* y, int64_t N, int64_t nb_begin,
            int64_t nb_end) {
  int64_t nb = nb_begin;
  for (; nb + NB <= nb_end; nb += NB) tile<NB, MB>(x, K, w, bias, y, N, nb);
  for (; nb < nb_end; ++nb) tile<1, MB>(x, K, w, bias, y, N, nb);
}

// One column block for 3 or more rows, six at a time (12 sums + 2 weights + 1 zero + 1 broadcast: the 16 ymm), the
// rest with a tile of their exact count. The block's weights (K x 32 bytes) stay in L1 from one group of rows to
// the next.
void many(const float* x, int64_t M, int64_t K, const int16_t* w, const float* bias, float* y, int64_t N,
          int64_t nb) {
  int64_t m0 = 0;
  for (; m0 + 6 <= M; m0 += 6) tile<1, 6>(x + m0 * K, K, w, bias, y + m0 * N, N, nb);
  const float* xr = x + m0 * K;
  float* yr = y + m0 * N;
  switch (M - m0) {
    case 1: tile<1, 1>(xr, K, w, bias, yr, N, nb); break;
    case 2: tile<1, 2>(xr, K, w, bias, yr, N, nb); break;
    case 3: tile<1, 3>(xr, K, w, bias, yr, N, nb); break;
    case 4: tile<1, 4>(xr, K, w, bias, yr, N, nb); break;
    case 5: tile<1, 5>(xr, K, w, bias, yr, N, nb); break;
    default: break;
  }
}

}  // namespace

torch::Tensor bf16_weight_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kShort && packed.size(2) == kCols &&
              packed.is_contiguous(), "packed: contiguous int16 [N/16, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(K == packed.size(1) && (N + kCols - 1) / kCols == NB, "shapes do not match");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
              "bias: contiguous fp32 [N]");
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int16_t* wp = packed.data_ptr<int16_t>();
  float* yp = y.data_ptr<float>();
  // A grain of 4 blocks: SmolLM2's k and v projections (12 blocks each) still split over two threads.
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    if (M == 1) {
      blocks<4, 1>(xp, K, wp, bp, yp, N, b0, b1);  // 8 independent sums: enough FMAs in flight to stream
    } else if (M == 2) {
      blocks<2, 2>(xp, K, wp, bp, yp, N, b0, b1);
    } else {
      for (int64_t nb = b0; nb < b1; ++nb) many(xp, M, K, wp, bp, yp, N, nb);
    }
  });
  return y;
}
