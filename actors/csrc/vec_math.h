// Vector helpers the AVX512-BF16 kernels share (decode_attention.cpp, rms_norm.cpp, silu_mul.cpp).
#pragma once
#include <torch/extension.h>
#include <immintrin.h>

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

}  // namespace vec_math
