// One decode step's attention for every decoding row of a batch, in one call: each row writes its new key and
// value into its own cache and attends with its one query to its cached span. The rows' caches stay separate
// tensors of their own lengths (actors/kv_cache.py): nothing is padded or copied together.
//
// q: [R, H, D] bf16; k_new, v_new: [R, H_kv, D] bf16; k_caches[r], v_caches[r]: [1, H_kv, S_r, D] bf16,
// contiguous; pos[r]: where row r's new key goes; start[r]: its oldest visible position (a sliding window).
// Row r attends to positions [start[r], pos[r]]. Scores, softmax and the weighted sum in fp32; out [R, H, D] bf16,
// rounded once. Built with -mavx512bf16 by actors/cpu_kernels.py; called only where the CPU has it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline __m512 load16(const at::BFloat16* p) {  // 16 bf16 -> 16 fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// One KV head of one row: its G query heads against keys [t0, t1) of k [S, D], v [S, D] (D % 16 == 0).
void attend(const at::BFloat16* q, int64_t G, const at::BFloat16* k, const at::BFloat16* v, int64_t t0, int64_t t1,
            int64_t D, float scale, at::BFloat16* out, std::vector<float>& scores) {
  const int64_t T = t1 - t0;
  for (int64_t g = 0; g < G; ++g) {
    const at::BFloat16* qg = q + g * D;
    float* s = scores.data();
    float max_s = -INFINITY;
    for (int64_t t = 0; t < T; ++t) {
      const at::BFloat16* kt = k + (t0 + t) * D;
      __m512 acc = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 32 <= D; d += 32) {  // 32 features: 16 pairs a VDPBF16PS
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + d), (__m512bh)_mm512_loadu_si512(kt + d));
      }
      float dot = _mm512_reduce_add_ps(acc);
      if (d < D) {  // the last 16 features (D = 16, 48, 80, ...)
        __m256 half = _mm256_dpbf16_ps(_mm256_setzero_ps(), (__m256bh)_mm256_loadu_si256((const __m256i*)(qg + d)),
                                       (__m256bh)_mm256_loadu_si256((const __m256i*)(kt + d)));
        dot += _mm512_reduce_add_ps(_mm512_zextps256_ps512(half));  // the upper half zero
      }
      s[t] = dot * scale;
      max_s = std::max(max_s, s[t]);
    }
    float sum = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      s[t] = std::exp(s[t] - max_s);
      sum += s[t];
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; d += 16) {
      __m512 o = _mm512_setzero_ps();
      for (int64_t t = 0; t < T; ++t) {
        o = _mm512_fmadd_ps(_mm512_set1_ps(s[t]), load16(v + (t0 + t) * D + d), o);
      }
      o = _mm512_mul_ps(o, _mm512_set1_ps(inv));
      _mm256_storeu_si256((__m256i*)(out + g * D + d), (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

}  // namespace

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                               const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                               const std::vector<int64_t>& pos, const std::vector<int64_t>& start) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(), "q: contiguous bf16 [R, H, D]");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(k_new.dim() == 3 && k_new.size(0) == R && k_new.size(2) == D && k_new.is_contiguous() &&
              v_new.sizes() == k_new.sizes() && v_new.is_contiguous() && k_new.scalar_type() == at::kBFloat16 &&
              v_new.scalar_type() == at::kBFloat16, "k_new, v_new: contiguous bf16 [R, H_kv, D]");
  const int64_t Hkv = k_new.size(1);
  TORCH_CHECK(H % Hkv == 0 && D % 16 == 0, "H a multiple of H_kv, D a multiple of 16");
  TORCH_CHECK((int64_t)k_caches.size() == R && (int64_t)v_caches.size() == R && (int64_t)pos.size() == R &&
              (int64_t)start.size() == R, "one cache, position and start per row");
  for (int64_t r = 0; r < R; ++r) {
    const auto& kc = k_caches[r];
    TORCH_CHECK(kc.dim() == 4 && kc.size(0) == 1 && kc.size(1) == Hkv && kc.size(3) == D && kc.is_contiguous() &&
                kc.scalar_type() == at::kBFloat16 && v_caches[r].sizes() == kc.sizes() && v_caches[r].is_contiguous() &&
                v_caches[r].scalar_type() == at::kBFloat16, "caches: contiguous bf16 [1, H_kv, S, D]");
    TORCH_CHECK(0 <= start[r] && start[r] <= pos[r] && pos[r] < kc.size(2), "positions outside the cache");
  }
  auto out = torch::empty({R, H, D}, q.options());
  const int64_t G = H / Hkv;
  const float scale = 1.f / std::sqrt((float)D);
  const auto* qp = q.data_ptr<at::BFloat16>();
  const auto* knp = k_new.data_ptr<at::BFloat16>();
  const auto* vnp = v_new.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, R * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / Hkv, h = i % Hkv, S = k_caches[r].size(2);
      auto* kc = k_caches[r].data_ptr<at::BFloat16>() + h * S * D;
      auto* vc = v_caches[r].data_ptr<at::BFloat16>() + h * S * D;
      std::memcpy(kc + pos[r] * D, knp + (r * Hkv + h) * D, D * sizeof(at::BFloat16));  // the row's new key
      std::memcpy(vc + pos[r] * D, vnp + (r * Hkv + h) * D, D * sizeof(at::BFloat16));
      scores.resize(pos[r] + 1 - start[r]);
      attend(qp + (r * H + h * G) * D, G, kc, vc, start[r], pos[r] + 1, D, scale, op + (r * H + h * G) * D, scores);
    }
  });
  return out;
}
