// decode_attention.cpp's one call a layer for every decoding row, for fp32 models on AVX2 CPUs: each row writes its
// new key and value into its own cache and attends with its one query to its cached span, with no padding.
//
// qkv: [R, (H + 2 H_kv) D] fp32, each row's query heads, new key and new value side by side (the joined
// projection's output); k_caches[r], v_caches[r]: [1, H_kv, S_r, D] fp32, contiguous; pos[r]: where row r's new
// key goes; start[r]: its oldest visible position (a sliding window); cos, sin: [R, D], each row's RoPE tables
// (rope.py's, sin signed), or none where q and k come roped. Row r attends to positions [start[r], pos[r]].
// out [R, H, D] fp32. Built with -mavx2 -mfma by actors/cpu_kernels.py; D % 8 == 0.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

constexpr int64_t kOutRegs = 8;  // 64 output features of a head summed at once: 8 ymm

// One KV head of one row: its G query heads against keys [t0, t1) of k [S, D], v [S, D].
void attend(const float* q, int64_t G, const float* k, const float* v, int64_t t0, int64_t t1, int64_t D,
            float scale, float* out, std::vector<float>& scores) {
  const int64_t T = t1 - t0;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float* s = scores.data();
    float max_s = -INFINITY;
    for (int64_t t = 0; t < T; ++t) {
      const float* kt = k + (t0 + t) * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();  // two chains: half the FMA latency
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kt + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(kt + d + 8), a1);
      }
      if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kt + d), a0);
      s[t] = hsum(_mm256_add_ps(a0, a1)) * scale;
      max_s = std::max(max_s, s[t]);
    }
    float sum = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      s[t] = std::exp(s[t] - max_s);
      sum += s[t];
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int64_t d0 = 0; d0 < D; d0 += kOutRegs * 8) {  // each value row read in order, 64 features at a time
      const int64_t n = std::min<int64_t>(kOutRegs, (D - d0) / 8);
      __m256 o[kOutRegs];
      for (int64_t j = 0; j < kOutRegs; ++j) o[j] = _mm256_setzero_ps();
      for (int64_t t = 0; t < T; ++t) {
        const __m256 w = _mm256_set1_ps(s[t]);
        const float* vt = v + (t0 + t) * D + d0;
        for (int64_t j = 0; j < n; ++j) o[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * j), o[j]);
      }
      for (int64_t j = 0; j < n; ++j) _mm256_storeu_ps(out + g * D + d0 + 8 * j, _mm256_mul_ps(o[j], inv));
    }
  }
}

// RoPE of one head as actors/rope.py's apply_rope: x * cos, plus roll(x) * signed_sin.
inline void rope(const float* x, const float* cos, const float* ssin, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = x[d] * cos[d] + x[(d + D / 2) % D] * ssin[d];
}

}  // namespace

torch::Tensor decode_attention_f32(const torch::Tensor& qkv, int64_t H, int64_t Hkv,
                                   const std::vector<torch::Tensor>& k_caches,
                                   const std::vector<torch::Tensor>& v_caches, const std::vector<int64_t>& pos,
                                   const std::vector<int64_t>& start, const c10::optional<torch::Tensor>& cos,
                                   const c10::optional<torch::Tensor>& sin) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "qkv: contiguous fp32 [R, (H + 2 H_kv) D]");
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && !k_caches.empty(), "H a multiple of H_kv, and rows");
  const int64_t R = qkv.size(0), D = k_caches[0].size(-1), width = (H + 2 * Hkv) * D, G = H / Hkv;
  TORCH_CHECK(D % 8 == 0 && qkv.size(1) == width, "D a multiple of 8, and qkv [R, (H + 2 H_kv) D]");
  TORCH_CHECK((int64_t)k_caches.size() == R && (int64_t)v_caches.size() == R && (int64_t)pos.size() == R &&
              (int64_t)start.size() == R, "one cache, position and start per row");
  for (int64_t r = 0; r < R; ++r) {
    const auto& kc = k_caches[r];
    TORCH_CHECK(kc.dim() == 4 && kc.size(0) == 1 && kc.size(1) == Hkv && kc.size(3) == D && kc.is_contiguous() &&
                kc.scalar_type() == at::kFloat && v_caches[r].sizes() == kc.sizes() && v_caches[r].is_contiguous() &&
                v_caches[r].scalar_type() == at::kFloat, "caches: contiguous fp32 [1, H_kv, S, D]");
    TORCH_CHECK(0 <= start[r] && start[r] <= pos[r] && pos[r] < kc.size(2), "positions outside the cache");
  }
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin together");
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() &&
                                    (*t)->dim() == 2 && (*t)->size(0) == R && (*t)->size(1) == D),
                "cos, sin: contiguous fp32 [R, D], each row's position");
  }
  auto out = torch::empty({R, H, D}, qkv.options());
  const float* base = qkv.data_ptr<float>();
  const float* cp = cos ? cos->data_ptr<float>() : nullptr;
  const float* sp = sin ? sin->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt((float)D);
  // Every (row, KV head) in turn, split over torch's threads.
  at::parallel_for(0, R * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    std::vector<float> roped(cp == nullptr ? 0 : G * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / Hkv, h = i % Hkv, S = k_caches[r].size(2);
      const float* row = base + r * width;
      float* kc = k_caches[r].data_ptr<float>() + h * S * D;
      float* vc = v_caches[r].data_ptr<float>() + h * S * D;
      const float* k_new = row + H * D + h * D;
      const float* q = row + h * G * D;
      if (cp != nullptr) {
        rope(k_new, cp + r * D, sp + r * D, D, kc + pos[r] * D);
        for (int64_t g = 0; g < G; ++g) rope(q + g * D, cp + r * D, sp + r * D, D, roped.data() + g * D);
        q = roped.data();
      } else {
        std::memcpy(kc + pos[r] * D, k_new, D * sizeof(float));
      }
      std::memcpy(vc + pos[r] * D, row + (H + Hkv) * D + h * D, D * sizeof(float));
      scores.resize(pos[r] + 1 - start[r]);
      attend(q, G, kc, vc, start[r], pos[r] + 1, D, scale, op + (r * H + h * G) * D, scores);
    }
  });
  return out;
}
