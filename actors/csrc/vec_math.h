// Vector helpers the AVX512-BF16 kernels share (decode_attention.cpp, decode_attention_i8.cpp, rms_norm.cpp,
// silu_mul.cpp).
#pragma once
#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>

namespace vec_math {

inline __m512 load16(const at::BFloat16* p) {  // 16 bf16 -> 16 fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

inline __mmask16 tail(int64_t k, int64_t K) { return k + 16 <= K ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1); }

inline __m512 load16(const at::BFloat16* p, __mmask16 m) {  // as above, masked lanes 0
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline __m512 round_bf16(__m512 v) {  // RNE to bf16 and back, as a torch bf16 tensor would hold it
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// exp(x) of 16 lanes: Cephes' expf, 2^n times a degree-7 polynomial of the rest, within about one fp32 rounding of
// the exact value; inf above ~88.7, as expf. Below -87.3 it is exp(-87.3) (~1e-38), not the denormal or 0 expf
// gives: next to the 1 it is added to or the max it is relative to, the same.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The horizontal sums of 16 vectors in one: lane i = the sum of v[i]'s lanes, in a fixed order. A quarter of
// the shuffles of one full reduction per vector.
// Add: how two lanes sum (fp32 sums, or int32 ones held in the same registers: the shuffles only move bits).
struct AddPs {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
};
struct AddEpi32 {
  __m512 operator()(__m512 a, __m512 b) const {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
};
template <typename Add = AddPs>
inline __m512 sum_lanes16(const __m512* v, Add add = Add()) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {  // w[i]: v[2i]'s 128-bit lanes {0+2, 1+3} in its lanes 0-1, v[2i+1]'s in 2-3
    w[i] = add(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
               _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // x[i]: 128-bit lane l holds four partial sums of v[4i + l]
    x[i] = add(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
               _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // y[i]: lane l holds two partial sums each of x[2i] and x[2i+1]'s lane l
    y[i] = add(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  }
  // z: element e of 128-bit lane l = the sum of v[4e + l]; put it at 4e + l.
  const __m512 z = add(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

// RoPE of one head as actors/rope.py's apply_rope computes it in bf16: x * cos rounded, then + roll(x) * signed_sin
// rounded once (torch's bf16 addcmul sums in fp32). Sixteen features at a time where each half of the head is
// whole blocks of 16 (D = 32, 64, 128, ...: a block's rolled partner is then one block too); one by one otherwise.
inline void rope(const at::BFloat16* x, const at::BFloat16* cos, const at::BFloat16* ssin, int64_t D,
                 at::BFloat16* out) {
  const int64_t half = D / 2;
  if (half % 16 == 0) {
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 xd = load16(x + d), rolled = load16(x + (d + half) % D);
      const __m512 scaled = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(xd, load16(cos + d))));
      const __m512 sum = _mm512_add_ps(scaled, _mm512_mul_ps(rolled, load16(ssin + d)));
      _mm256_storeu_si256((__m256i*)(out + d), (__m256i)_mm512_cvtneps_pbh(sum));
    }
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    const float scaled = (float)at::BFloat16((float)x[d] * (float)cos[d]);
    out[d] = at::BFloat16(scaled + (float)x[(d + half) % D] * (float)ssin[d]);
  }
}

// One block of 16 scores in a query head's running softmax (the one-pass kernels of decode_attention.cpp and
// decode_attention_i8.cpp): where their max passes the running one, what was summed so far (acc, sum) is rescaled
// to it; returns exp(st - max) with the lanes not kept 0 (st holds -inf there), added into sum.
template <int NB>
inline __m512 softmax_block(__m512 st, __mmask16 keep, float& max_s, __m512& sum, __m512 (&acc)[NB]) {
  const float block_max = _mm512_reduce_max_ps(st);
  if (block_max > max_s) {  // exp(-inf) = 0 at the start
    const __m512 c = _mm512_set1_ps(std::exp(max_s - block_max));
    for (auto& a : acc) a = _mm512_mul_ps(a, c);
    sum = _mm512_mul_ps(sum, c);
    max_s = block_max;
  }
  // exp16 clamps -inf to ~1e-38, not 0: the lanes not kept are zeroed here.
  const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(st, _mm512_set1_ps(max_s))));
  sum = _mm512_add_ps(sum, e);
  return e;
}

// Query heads a one-pass call takes: NG x NB sums (and NB value blocks, or as many int32 sums) in the 32 vector
// registers, about; a KV head with more query heads takes another pass over its span (its keys and values then
// mostly from the L2 cache).
constexpr int64_t heads_a_pass(int64_t NB) { return NB <= 4 ? 4 : 2; }

}  // namespace vec_math
