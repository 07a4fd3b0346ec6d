// decode_attention.cpp's step over 8-bit caches (actors/kv_cache.py, `kv_dtype: int8`): half the bytes a decoding
// row reads from its cache, which is what bounds that kernel (batch.md: within ~11% of a bare read of its bytes).
//
// A cache is int8 [1, H_kv, S, D + 4]: each KV head's block of S (D + 4) bytes holds the S x D values, then the S
// fp32 scales, one a position (absmax / 127 of that position's D features, symmetric, rounded to nearest even: the
// values are round(x / scale)). kv_cache.py's `quantize` computes the same bits from torch.
//
// Keys: the query head is quantized the same way once a step, and each key's dot product is one VPDPBUSD of 64
// int8 pairs (the keys made unsigned by + 128, whose share, 128 * sum(q), is taken off once a head); exact in
// int32, then scaled by both scales in fp32. Values: widened to fp32 16 at a time, each weighed by its softmax
// weight times its scale. Scores, softmax and the sums in fp32 as decode_attention.cpp's; out [R, H, D] bf16.
// One pass over each (row, KV head) span (up to 4 query heads a KV head and D up to 64); `decode_attention`
// dispatches here when its caches are int8, and actors/attention.py sends other shapes through torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace {

using vec_math::exp16;
using vec_math::load16;
using vec_math::rope;
using vec_math::sum_lanes16;

constexpr int64_t KB = 16;  // keys a block: one vector of their scores

// One head's D features (bf16) -> D int8 values and their scale, as kv_cache.quantize.
inline void quantize(const at::BFloat16* x, int64_t D, int8_t* values, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x + d)));
  const float s = _mm512_reduce_max_ps(amax) / 127.f;
  *scale = s;
  if (s == 0.f) {
    std::memset(values, 0, D);
    return;
  }
  for (int64_t d = 0; d < D; d += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load16(x + d), _mm512_set1_ps(s)));  // nearest even
    _mm_storeu_si128((__m128i*)(values + d), _mm512_cvtsepi32_epi8(q));
  }
}

// One KV head of one row over keys [t0, t1): its NG query heads q [NG, D] (roped), values and scales of k and v
// as laid out above, into out [NG, D] bf16. NB = D / 16.
template <int NG, int NB>
void attend_online(const at::BFloat16* q, const int8_t* kv, const float* ks, const int8_t* vv, const float* vs,
                   int64_t t0, int64_t t1, float scale, at::BFloat16* out) {
  constexpr int64_t D = 16 * NB;
  const int64_t T = t1 - t0;
  // The query heads in int8, zero past D: q8[g] . (k + 128) = q8[g] . k + 128 * qsum[g].
  alignas(64) int8_t q8[NG][64];
  float q_scale[NG];
  __m512i qv[NG];
  int32_t qsum[NG];
  for (int g = 0; g < NG; ++g) {
    std::memset(q8[g], 0, 64);
    quantize(q + g * D, D, q8[g], &q_scale[g]);
    qv[g] = _mm512_load_si512(q8[g]);
    int32_t s = 0;
    for (int64_t d = 0; d < D; ++d) s += q8[g][d];
    qsum[g] = s;
  }
  __m512 acc[NG][NB], sum[NG];
  float max_s[NG];
  for (int g = 0; g < NG; ++g) {
    for (auto& a : acc[g]) a = _mm512_setzero_ps();
    sum[g] = _mm512_setzero_ps();
    max_s[g] = -INFINITY;
  }
  const __mmask64 features = D == 64 ? ~0ULL : (1ULL << D) - 1;
  alignas(64) uint8_t keys[KB][64];  // a block's keys + 128, zero-padded to 64 (times q8's zeros: 0)
  alignas(64) float p[NG][KB];
  for (int64_t t = 0; t < T; t += KB) {
    const int64_t n = std::min<int64_t>(KB, T - t);
    const __mmask16 keep = n == KB ? 0xFFFF : (__mmask16)((1u << n) - 1);
    for (int64_t j = 0; j < KB; ++j) {  // a short last block repeats its last key; its scores are masked
      const int8_t* kt = kv + (t0 + t + std::min(j, n - 1)) * D;
      _mm512_store_si512(keys[j], _mm512_xor_si512(_mm512_maskz_loadu_epi8(features, kt),
                                                    _mm512_maskz_set1_epi8(features, (char)0x80)));
    }
    const __m512 k_scale = _mm512_maskz_loadu_ps(keep, ks + t0 + t);
    const __m512 v_scale = _mm512_maskz_loadu_ps(keep, vs + t0 + t);
    for (int g = 0; g < NG; ++g) {
      __m512 dots[KB];
      for (int64_t j = 0; j < KB; ++j) {
        dots[j] = _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(keys[j]), qv[g]));
      }
      const __m512i exact = _mm512_sub_epi32(_mm512_castps_si512(sum_lanes16(dots, vec_math::AddEpi32())),
                                             _mm512_set1_epi32(128 * qsum[g]));
      const __m512 st = _mm512_mask_mov_ps(  // the padding's scores: -inf
          _mm512_set1_ps(-INFINITY), keep,
          _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(k_scale, _mm512_set1_ps(q_scale[g] * scale))));
      const float block_max = _mm512_reduce_max_ps(st);
      if (block_max > max_s[g]) {  // rescale what was summed against the old max (exp(-inf) = 0 at the start)
        const __m512 c = _mm512_set1_ps(std::exp(max_s[g] - block_max));
        for (auto& a : acc[g]) a = _mm512_mul_ps(a, c);
        sum[g] = _mm512_mul_ps(sum[g], c);
        max_s[g] = block_max;
      }
      const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(st, _mm512_set1_ps(max_s[g]))));
      sum[g] = _mm512_add_ps(sum[g], e);
      _mm512_store_ps(p[g], _mm512_mul_ps(e, v_scale));  // each value's weight, its scale folded in
    }
    for (int64_t j = 0; j < n; ++j) {
      const int8_t* vt = vv + (t0 + t + j) * D;
      __m512 vb[NB];
      for (int b = 0; b < NB; ++b) {
        vb[b] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(vt + 16 * b))));
      }
      for (int g = 0; g < NG; ++g) {
        const __m512 w = _mm512_set1_ps(p[g][j]);
        for (int b = 0; b < NB; ++b) acc[g][b] = _mm512_fmadd_ps(w, vb[b], acc[g][b]);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum[g]));
    for (int b = 0; b < NB; ++b) {
      _mm256_storeu_si256((__m256i*)(out + g * D + 16 * b), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][b], inv)));
    }
  }
}

using AttendOnline = void (*)(const at::BFloat16*, const int8_t*, const float*, const int8_t*, const float*, int64_t,
                              int64_t, float, at::BFloat16*);
const AttendOnline ATTEND_ONLINE[4][4] = {
    {attend_online<1, 1>, attend_online<1, 2>, attend_online<1, 3>, attend_online<1, 4>},
    {attend_online<2, 1>, attend_online<2, 2>, attend_online<2, 3>, attend_online<2, 4>},
    {attend_online<3, 1>, attend_online<3, 2>, attend_online<3, 3>, attend_online<3, 4>},
    {attend_online<4, 1>, attend_online<4, 2>, attend_online<4, 3>, attend_online<4, 4>},
};

// A KV head's values [S, D] and scales [S] inside an int8 cache's block of head h.
struct HeadBlock {
  int8_t* values;
  float* scales;
};

inline HeadBlock head_block(const torch::Tensor& cache, int64_t h, int64_t D) {
  const int64_t S = cache.size(2);
  int8_t* block = cache.data_ptr<int8_t>() + h * S * (D + 4);
  return {block, reinterpret_cast<float*>(block + S * D)};
}

}  // namespace

// decode_attention's arguments, as it has checked them, every cache int8 [1, H_kv, S_r, D + 4].
torch::Tensor decode_attention_i8(const torch::Tensor& qkv, int64_t H, int64_t Hkv,
                                  const std::vector<torch::Tensor>& k_caches,
                                  const std::vector<torch::Tensor>& v_caches, const std::vector<int64_t>& pos,
                                  const std::vector<int64_t>& start, const c10::optional<torch::Tensor>& cos,
                                  const c10::optional<torch::Tensor>& sin) {
  const int64_t R = qkv.size(0), D = k_caches[0].size(-1) - 4, G = H / Hkv;
  TORCH_CHECK(D > 0 && D % 16 == 0 && D <= 64 && G <= 4,
              "int8 caches: head_dim a multiple of 16 up to 64, and up to 4 query heads a KV head");
  auto out = torch::empty({R, H, D}, qkv.options());
  const at::BFloat16* base = qkv.data_ptr<at::BFloat16>();
  const at::BFloat16* cos_p = cos ? cos->data_ptr<at::BFloat16>() : nullptr;
  const at::BFloat16* sin_p = sin ? sin->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* out_p = out.data_ptr<at::BFloat16>();
  const int64_t width = (H + 2 * Hkv) * D;
  const float scale = 1.f / std::sqrt((float)D);
  at::parallel_for(0, R * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<at::BFloat16> roped(G * D), k_roped(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / Hkv, h = i % Hkv;
      const at::BFloat16* row = base + r * width;
      const HeadBlock k = head_block(k_caches[r], h, D), v = head_block(v_caches[r], h, D);
      const at::BFloat16* k_new = row + H * D + h * D;
      const at::BFloat16* q = row + h * G * D;
      if (cos_p != nullptr) {  // rows' tables: [R, D]
        rope(k_new, cos_p + r * D, sin_p + r * D, D, k_roped.data());
        for (int64_t g = 0; g < G; ++g) rope(q + g * D, cos_p + r * D, sin_p + r * D, D, roped.data() + g * D);
        k_new = k_roped.data();
        q = roped.data();
      }
      quantize(k_new, D, k.values + pos[r] * D, k.scales + pos[r]);
      quantize(row + (H + Hkv) * D + h * D, D, v.values + pos[r] * D, v.scales + pos[r]);
      ATTEND_ONLINE[G - 1][D / 16 - 1](q, k.values, k.scales, v.values, v.scales, start[r], pos[r] + 1, scale,
                                       out_p + (r * H + h * G) * D);
    }
  });
  return out;
}
