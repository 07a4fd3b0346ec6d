// decode_attention.cpp's step over 8-bit caches (actors/kv_cache.py, `kv_dtype: int8`): half the bytes a decoding
// row reads from its cache, which is what bounds that kernel at long contexts (batch.md).
//
// A cache is int8 [1, H_kv, S, D + 4], S a multiple of 16. Each KV head's block of S (D + 4) bytes holds its S x D
// values, then its S fp32 scales, one a position (absmax / 127 of that position's D features, symmetric; the values
// round(x / scale), to nearest even). The values are tiled for the instruction that reads them (kv_cache.py's
// `TILES`; its `quantize` computes the same bits from torch):
//   keys   [S / 16][D / 4][16][4]: 16 positions' 4 features a 64-byte row, what one VPDPBUSD dots with 4 of the
//          query's features broadcast: a vector of 16 keys' partial sums, with no horizontal sum;
//   values [S / 2][D][2]: each feature's two positions side by side, what one VPDPWSSD weighs with the two
//          positions' weights (in 16 bits, exact enough: 2^-15 of the block's largest) into 16 features.
// Keys: the query head is quantized the same way once a step and the keys made unsigned by + 128, whose share,
// 128 * sum(q), is taken off once a block; exact in int32, then scaled by both scales in fp32. Values: each block's
// weights (softmax times the value's scale) in int16 against their largest, the block's int32 sums scaled back into
// fp32 ones. Scores, softmax and the sums otherwise as decode_attention.cpp's; out [R, H, D] bf16. One pass over each
// (row, KV head) span for up to 4 of its query heads (2 where D > 64), D up to 128; `decode_attention` dispatches
// here when its caches are int8, and actors/attention.py sends larger heads through torch.
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

using vec_math::heads_a_pass;
using vec_math::load16;
using vec_math::rope;
using vec_math::softmax_block;

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

// One KV head of one row over keys [t0, t1): its NG query heads q [NG, D] (roped), the tiled values and the scales
// of k and v as laid out above, into out [NG, D] bf16. NB = D / 16. Blocks of 16 positions from a multiple of 16;
// positions outside the span weigh 0.
template <int NG, int NB>
void attend_online(const at::BFloat16* q, const int8_t* kv, const float* ks, const int8_t* vv, const float* vs,
                   int64_t t0, int64_t t1, float scale, at::BFloat16* out) {
  constexpr int64_t D = 16 * NB;
  // The query heads in int8, as 4-feature words to broadcast: q8[g] . (k + 128) = q8[g] . k + 128 * qsum[g].
  alignas(64) int8_t q8[NG][D];
  float q_scale[NG];
  int32_t qsum[NG];
  for (int g = 0; g < NG; ++g) {
    quantize(q + g * D, D, q8[g], &q_scale[g]);
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
  alignas(64) int16_t w16[NG][KB];  // a block's weights in 16 bits: pairs of positions, broadcast as int32
  float w_scale[NG];
  for (int64_t t = t0 / KB * KB; t < t1; t += KB) {
    const __mmask16 keep = (__mmask16)(((t1 - t >= KB ? 0xFFFFu : (1u << (t1 - t)) - 1)) &
                                       (t0 > t ? ~((1u << (t0 - t)) - 1) : 0xFFFFu));
    const int8_t* kb = kv + t * D;  // the block's keys: [D / 4][16][4]
    __m512i dots[NG];
    for (auto& d : dots) d = _mm512_setzero_si512();
    for (int64_t i = 0; i < D / 4; ++i) {
      const __m512i k4 = _mm512_xor_si512(_mm512_loadu_si512(kb + 64 * i), _mm512_set1_epi8((char)0x80));
      for (int g = 0; g < NG; ++g) {
        int32_t word;
        std::memcpy(&word, q8[g] + 4 * i, 4);
        dots[g] = _mm512_dpbusd_epi32(dots[g], k4, _mm512_set1_epi32(word));
      }
    }
    const __m512 k_scale = _mm512_maskz_loadu_ps(keep, ks + t), v_scale = _mm512_maskz_loadu_ps(keep, vs + t);
    for (int g = 0; g < NG; ++g) {
      const __m512i exact = _mm512_sub_epi32(dots[g], _mm512_set1_epi32(128 * qsum[g]));
      const __m512 st = _mm512_mask_mov_ps(  // positions outside the span: -inf
          _mm512_set1_ps(-INFINITY), keep,
          _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(k_scale, _mm512_set1_ps(q_scale[g] * scale))));
      const __m512 e = softmax_block(st, keep, max_s[g], sum[g], acc[g]);
      const __m512 w = _mm512_mul_ps(e, v_scale);  // each value's weight, its scale folded in; >= 0
      const float w_max = _mm512_reduce_max_ps(w);
      w_scale[g] = w_max / 32767.f;
      const __m512 wq = w_max > 0.f ? _mm512_mul_ps(w, _mm512_set1_ps(32767.f / w_max)) : _mm512_setzero_ps();
      _mm256_store_si256((__m256i*)w16[g], _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(wq)));
    }
    // The block's values: sums of 16 products of at most 127 x 32767 a lane, well inside int32.
    __m512i sums[NG][NB];
    for (auto& row : sums) for (auto& a : row) a = _mm512_setzero_si512();
    for (int64_t p = 0; p < KB / 2; ++p) {  // positions t + 2p and t + 2p + 1: [D][2]
      const int8_t* vp = vv + (t + 2 * p) * D;
      __m512i v2[NB];
      for (int b = 0; b < NB; ++b) v2[b] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(vp + 32 * b)));
      for (int g = 0; g < NG; ++g) {
        int32_t pair;
        std::memcpy(&pair, w16[g] + 2 * p, 4);
        const __m512i wp = _mm512_set1_epi32(pair);
        for (int b = 0; b < NB; ++b) sums[g][b] = _mm512_dpwssd_epi32(sums[g][b], v2[b], wp);
      }
    }
    for (int g = 0; g < NG; ++g) {
      const __m512 ws = _mm512_set1_ps(w_scale[g]);
      for (int b = 0; b < NB; ++b) acc[g][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[g][b]), ws, acc[g][b]);
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
template <int NG>
constexpr AttendOnline BY_NB[8] = {attend_online<NG, 1>, attend_online<NG, 2>, attend_online<NG, 3>,
                                   attend_online<NG, 4>, attend_online<NG, 5>, attend_online<NG, 6>,
                                   attend_online<NG, 7>, attend_online<NG, 8>};
const AttendOnline* const ATTEND_ONLINE[4] = {BY_NB<1>, BY_NB<2>, BY_NB<3>, BY_NB<4>};

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
  TORCH_CHECK(D > 0 && D % 16 == 0 && D <= 128, "int8 caches: head_dim a multiple of 16 up to 128");
  for (const auto* caches : {&k_caches, &v_caches}) {
    for (const auto& c : *caches) TORCH_CHECK(c.size(2) % KB == 0, "int8 caches: positions a multiple of 16");
  }
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
      const int64_t t = pos[r];
      alignas(64) int8_t k8[128], v8[128];  // D <= 128
      quantize(k_new, D, k8, k.scales + t);
      quantize(row + (H + Hkv) * D + h * D, D, v8, v.scales + t);
      int8_t* k_tile = k.values + t / KB * KB * D + t % KB * 4;  // key tile row i at + 64 i
      for (int64_t i = 0; i < D / 4; ++i) std::memcpy(k_tile + 64 * i, k8 + 4 * i, 4);
      int8_t* v_pair = v.values + t / 2 * 2 * D + t % 2;  // feature d at + 2 d
      for (int64_t d = 0; d < D; ++d) v_pair[2 * d] = v8[d];
      const int64_t NB = D / 16, per_pass = heads_a_pass(NB);
      for (int64_t g = 0; g < G; g += per_pass) {
        const int64_t ng = std::min(per_pass, G - g);
        ATTEND_ONLINE[ng - 1][NB - 1](q + g * D, k.values, k.scales, v.values, v.scales, start[r], pos[r] + 1, scale,
                                      out_p + (r * H + h * G + g) * D);
      }
    }
  });
  return out;
}
