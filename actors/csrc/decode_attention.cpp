// One decode step's attention for every decoding row of a batch, in one call: each row writes its new key and
// value into its own cache and attends with its one query to its cached span. The rows' caches stay separate
// tensors of their own lengths (actors/kv_cache.py): nothing is padded or copied together.
//
// qkv: [R, (H + 2 H_kv) D] bf16, each row's query heads, new key and new value side by side (the fused
// projection's output, bf16_linear.Fused); k_caches[r], v_caches[r]: [1, H_kv, S_r, D] bf16, contiguous;
// pos[r]: where row r's new key goes; start[r]: its oldest visible position (a sliding window); cos, sin:
// [R, D], each row's RoPE tables (rope.py's), or none where q and k come roped.
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

// RoPE of one head as actors/rope.py's apply_rope computes it in bf16: x * cos rounded, then + roll(x) * signed_sin
// rounded once (torch's bf16 addcmul sums in fp32).
inline void rope(const at::BFloat16* x, const at::BFloat16* cos, const at::BFloat16* ssin, int64_t D,
                 at::BFloat16* out) {
  for (int64_t d = 0; d < D; ++d) {
    const float scaled = (float)at::BFloat16((float)x[d] * (float)cos[d]);
    out[d] = at::BFloat16(scaled + (float)x[(d + D / 2) % D] * (float)ssin[d]);
  }
}

// Where each row's query, new key and new value are: element offsets of row r's head h are
// r * row_stride + {q, k, v}_offset + h * D.
struct RowLayout {
  const at::BFloat16* base;
  int64_t row_stride, q_offset, k_offset, v_offset;
};

void check_caches(const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                  const std::vector<int64_t>& pos, const std::vector<int64_t>& start, int64_t R, int64_t Hkv,
                  int64_t D) {
  TORCH_CHECK((int64_t)k_caches.size() == R && (int64_t)v_caches.size() == R && (int64_t)pos.size() == R &&
              (int64_t)start.size() == R, "one cache, position and start per row");
  for (int64_t r = 0; r < R; ++r) {
    const auto& kc = k_caches[r];
    TORCH_CHECK(kc.dim() == 4 && kc.size(0) == 1 && kc.size(1) == Hkv && kc.size(3) == D && kc.is_contiguous() &&
                kc.scalar_type() == at::kBFloat16 && v_caches[r].sizes() == kc.sizes() && v_caches[r].is_contiguous() &&
                v_caches[r].scalar_type() == at::kBFloat16, "caches: contiguous bf16 [1, H_kv, S, D]");
    TORCH_CHECK(0 <= start[r] && start[r] <= pos[r] && pos[r] < kc.size(2), "positions outside the cache");
  }
}

// Every (row, KV head) in turn, split over torch's threads: the new key (roped where cos is given) and value
// written to the row's cache, then its G query heads (roped likewise) attended over its span into out [R, H, D].
void run(const RowLayout& in, int64_t R, int64_t H, int64_t Hkv, int64_t D, const std::vector<torch::Tensor>& k_caches,
         const std::vector<torch::Tensor>& v_caches, const std::vector<int64_t>& pos, const std::vector<int64_t>& start,
         const at::BFloat16* cos, const at::BFloat16* ssin, at::BFloat16* out) {
  const int64_t G = H / Hkv;
  const float scale = 1.f / std::sqrt((float)D);
  at::parallel_for(0, R * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    std::vector<at::BFloat16> roped(cos == nullptr ? 0 : G * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / Hkv, h = i % Hkv, S = k_caches[r].size(2);
      const at::BFloat16* row = in.base + r * in.row_stride;
      auto* kc = k_caches[r].data_ptr<at::BFloat16>() + h * S * D;
      auto* vc = v_caches[r].data_ptr<at::BFloat16>() + h * S * D;
      const at::BFloat16* k_new = row + in.k_offset + h * D;
      const at::BFloat16* q = row + in.q_offset + h * G * D;
      if (cos != nullptr) {  // rows' tables: [R, D]
        rope(k_new, cos + r * D, ssin + r * D, D, kc + pos[r] * D);
        for (int64_t g = 0; g < G; ++g) rope(q + g * D, cos + r * D, ssin + r * D, D, roped.data() + g * D);
        q = roped.data();
      } else {
        std::memcpy(kc + pos[r] * D, k_new, D * sizeof(at::BFloat16));
      }
      std::memcpy(vc + pos[r] * D, row + in.v_offset + h * D, D * sizeof(at::BFloat16));
      scores.resize(pos[r] + 1 - start[r]);
      attend(q, G, kc, vc, start[r], pos[r] + 1, D, scale, out + (r * H + h * G) * D, scores);
    }
  });
}

}  // namespace

torch::Tensor decode_attention(const torch::Tensor& qkv, int64_t H, int64_t Hkv,
                               const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                               const std::vector<int64_t>& pos, const std::vector<int64_t>& start,
                               const c10::optional<torch::Tensor>& cos, const c10::optional<torch::Tensor>& sin) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous(),
              "qkv: contiguous bf16 [R, (H + 2 H_kv) D]");
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && !k_caches.empty(), "H a multiple of H_kv, and rows");
  const int64_t R = qkv.size(0), D = k_caches[0].size(-1), width = (H + 2 * Hkv) * D;
  TORCH_CHECK(D % 16 == 0 && qkv.size(1) == width, "D a multiple of 16, and qkv [R, (H + 2 H_kv) D]");
  check_caches(k_caches, v_caches, pos, start, R, Hkv, D);
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin together");
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kBFloat16 && (*t)->is_contiguous() &&
                                    (*t)->dim() == 2 && (*t)->size(0) == R && (*t)->size(1) == D),
                "cos, sin: contiguous bf16 [R, D], each row's position");
  }
  auto out = torch::empty({R, H, D}, qkv.options());
  const RowLayout in{qkv.data_ptr<at::BFloat16>(), width, 0, H * D, (H + Hkv) * D};
  run(in, R, H, Hkv, D, k_caches, v_caches, pos, start, cos ? cos->data_ptr<at::BFloat16>() : nullptr,
      sin ? sin->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>());
  return out;
}
