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
//
// Each (row, KV head) is one pass over its keys and values for up to 4 of its query heads (2 where D > 64) where
// D <= 128 (`attend_online`), two passes otherwise (all the scores first, then the values; `attend`). One pass
// streams the keys and the values together while each block computes, where the two passes computed on the keys,
// then on the values, with the memory idle between: 3.33 ms against 3.72 for 8 rows at 1,024 positions of the demo's
// heads (benchmarks/results/batch.md's attention split as of commits c2a72e4 and 137e319). Passes of a few heads
// replaced the two passes for heads over 64 features and over 4 query heads a KV head at 0.87x their time for 16
// heads on 8 of 128 and 0.89x for 14 on 2 of 64, the same for 10 on 2 of 80 (8 rows at 1,024 positions, the old
// and new source built side by side and timed in turn, by hand).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace {

using vec_math::exp16;
using vec_math::heads_a_pass;
using vec_math::load16;
using vec_math::rope;
using vec_math::softmax_block;
using vec_math::sum_lanes16;

constexpr int64_t KB = 16;  // keys a block: one vector of their scores

inline __m512 loadbh(const at::BFloat16* p) { return _mm512_loadu_ps(p); }  // 32 bf16, as VDPBF16PS takes them
inline __m512 loadbh_half(const at::BFloat16* p) {  // 16 bf16 in the low half, zeros above: their products are 0
  return _mm512_castsi512_ps(_mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)p)));
}
inline __m512 dot_pairs(__m512 acc, __m512 a, __m512 b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_castps_si512(b));
}

// Query head q [D] dotted with the 16 keys kt[j] [D]: lane j = q . kt[j], fp32 sums of the bf16 products. Each key's
// products summed in its own vector, the sixteen reduced together.
inline __m512 block_dots(const at::BFloat16* q, const at::BFloat16* const* kt, int64_t D) {
  __m512 acc[KB];
  for (auto& a : acc) a = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {  // 32 features: 16 pairs a VDPBF16PS
    const __m512 qd = loadbh(q + d);
    for (int64_t j = 0; j < KB; ++j) acc[j] = dot_pairs(acc[j], qd, loadbh(kt[j] + d));
  }
  if (d < D) {  // the last 16 features (D = 16, 48, 80, ...)
    const __m512 qd = loadbh_half(q + d);
    for (int64_t j = 0; j < KB; ++j) acc[j] = dot_pairs(acc[j], qd, loadbh_half(kt[j] + d));
  }
  return sum_lanes16(acc);
}

// Scores of query head q [D] against keys [t0, t1) of k [S, D], times scale, into s [t1 - t0]; returns their max.
// Sixteen keys at a time (block_dots).
float score(const at::BFloat16* q, const at::BFloat16* k, int64_t t0, int64_t t1, int64_t D, float scale, float* s) {
  const int64_t T = t1 - t0;
  __m512 max_s = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < T; t += KB) {
    const at::BFloat16* kt[KB];
    for (int64_t j = 0; j < KB; ++j) kt[j] = k + (t0 + std::min(t + j, T - 1)) * D;  // a short block repeats its last
    const __mmask16 keep = T - t >= KB ? 0xFFFF : (__mmask16)((1u << (T - t)) - 1);
    const __m512 st = _mm512_mul_ps(block_dots(q, kt, D), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(s + t, keep, st);
    max_s = _mm512_mask_max_ps(max_s, keep, max_s, st);
  }
  return _mm512_reduce_max_ps(max_s);
}

// s [T] -> exp(s - max) in place; returns their sum.
float exponentiate(float* s, int64_t T, float max_s) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < T; t += KB) {
    const __mmask16 keep = T - t >= KB ? 0xFFFF : (__mmask16)((1u << (T - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + t), _mm512_set1_ps(max_s)));
    _mm512_mask_storeu_ps(s + t, keep, e);
    sum = _mm512_mask_add_ps(sum, keep, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// NG query heads' outputs over NB blocks of 16 features from d0: out_g = inv_g * sum_t w_g[t] v_t, v [S, D] read
// once for all NG heads, NG x NB independent sums (one chain each would wait on every FMA's latency).
template <int NG, int NB>
void weigh_values(const float* w, int64_t w_stride, const float* inv, const at::BFloat16* v, int64_t t0, int64_t T,
                  int64_t D, int64_t d0, at::BFloat16* out) {
  __m512 acc[NG][NB];
  for (auto& row : acc) for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t t = 0; t < T; ++t) {
    const at::BFloat16* vt = v + (t0 + t) * D + d0;
    __m512 vb[NB];
    for (int b = 0; b < NB; ++b) vb[b] = load16(vt + 16 * b);
    for (int g = 0; g < NG; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * w_stride + t]);
      for (int b = 0; b < NB; ++b) acc[g][b] = _mm512_fmadd_ps(wg, vb[b], acc[g][b]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    for (int b = 0; b < NB; ++b) {
      const __m512 o = _mm512_mul_ps(acc[g][b], _mm512_set1_ps(inv[g]));
      _mm256_storeu_si256((__m256i*)(out + g * D + d0 + 16 * b), (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

using WeighValues = void (*)(const float*, int64_t, const float*, const at::BFloat16*, int64_t, int64_t, int64_t,
                             int64_t, at::BFloat16*);
constexpr int MAX_NG = 4, MAX_NB = 4;  // 16 sums, 4 value blocks and a weight: 21 of the 32 vector registers
const WeighValues WEIGH_VALUES[MAX_NG][MAX_NB] = {
    {weigh_values<1, 1>, weigh_values<1, 2>, weigh_values<1, 3>, weigh_values<1, 4>},
    {weigh_values<2, 1>, weigh_values<2, 2>, weigh_values<2, 3>, weigh_values<2, 4>},
    {weigh_values<3, 1>, weigh_values<3, 2>, weigh_values<3, 3>, weigh_values<3, 4>},
    {weigh_values<4, 1>, weigh_values<4, 2>, weigh_values<4, 3>, weigh_values<4, 4>},
};

// One KV head of one row in one pass over its span: each block of KB keys is scored for all NG query heads (the
// keys from the L1 cache after the first head), each head's running max and sum updated (what it has summed so far
// rescaled where the max grew), then the block's values weighed in for every head. NB = D / 16: each head's NB sums
// of 16 features stay in registers (NG * NB <= 16). The values are widened 32 features a load, the even ones in
// one vector and the odd in the next (vb[b], vb[b + 1]), and interleaved back once at the end.
template <int NG, int NB>
void attend_online(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, int64_t t0, int64_t t1,
                   float scale, at::BFloat16* out) {
  constexpr int64_t D = 16 * NB;
  const int64_t T = t1 - t0;
  __m512 acc[NG][NB], sum[NG];
  float max_s[NG];
  for (int g = 0; g < NG; ++g) {
    for (auto& a : acc[g]) a = _mm512_setzero_ps();
    sum[g] = _mm512_setzero_ps();
    max_s[g] = -INFINITY;
  }
  alignas(64) float p[NG][KB];
  alignas(64) at::BFloat16 k_tail[KB * D];
  for (int64_t t = 0; t < T; t += KB) {
    const int64_t n = std::min<int64_t>(KB, T - t);
    const __mmask16 keep = n == KB ? 0xFFFF : (__mmask16)((1u << n) - 1);
    const at::BFloat16* kb = k + (t0 + t) * D;
    if (n < KB) {  // a short last block: scored from a copy padded with zeros, the padding's scores masked
      std::memset(k_tail, 0, sizeof(k_tail));
      std::memcpy(k_tail, kb, n * D * sizeof(at::BFloat16));
      kb = k_tail;
    }
    const at::BFloat16* kt[KB];
    for (int64_t j = 0; j < KB; ++j) kt[j] = kb + j * D;
    for (int g = 0; g < NG; ++g) {
      const __m512 st = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep,  // the padding's scores: -inf
                                           _mm512_mul_ps(block_dots(q + g * D, kt, D), _mm512_set1_ps(scale)));
      _mm512_store_ps(p[g], softmax_block(st, keep, max_s[g], sum[g], acc[g]));
    }
    for (int64_t j = 0; j < n; ++j) {
      const at::BFloat16* vt = v + (t0 + t + j) * D;
      __m512 vb[NB];
      for (int b = 0; b + 1 < NB; b += 2) {
        const __m512i raw = _mm512_loadu_si512(vt + 16 * b);
        vb[b] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));  // features 16b, 16b + 2, ...: each low half
        vb[b + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(0xFFFF0000)));  // the odd: high halves
      }
      if (NB % 2) vb[NB - 1] = load16(vt + 16 * (NB - 1));
      for (int g = 0; g < NG; ++g) {
        const __m512 w = _mm512_set1_ps(p[g][j]);
        for (int b = 0; b < NB; ++b) acc[g][b] = _mm512_fmadd_ps(w, vb[b], acc[g][b]);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum[g]));
    for (int b = 0; b + 1 < NB; b += 2) {  // even and odd features interleaved back: 16b .. 16b + 15, then the next 16
      const __m512 ev = _mm512_mul_ps(acc[g][b], inv), od = _mm512_mul_ps(acc[g][b + 1], inv);
      const __m512 lo = _mm512_permutex2var_ps(
          ev, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), od);
      const __m512 hi = _mm512_permutex2var_ps(
          ev, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), od);
      _mm256_storeu_si256((__m256i*)(out + g * D + 16 * b), (__m256i)_mm512_cvtneps_pbh(lo));
      _mm256_storeu_si256((__m256i*)(out + g * D + 16 * b + 16), (__m256i)_mm512_cvtneps_pbh(hi));
    }
    if (NB % 2) {
      _mm256_storeu_si256((__m256i*)(out + g * D + 16 * (NB - 1)),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][NB - 1], inv)));
    }
  }
}

using AttendOnline = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, float,
                              at::BFloat16*);
template <int NG>
constexpr AttendOnline BY_NB[8] = {attend_online<NG, 1>, attend_online<NG, 2>, attend_online<NG, 3>,
                                   attend_online<NG, 4>, attend_online<NG, 5>, attend_online<NG, 6>,
                                   attend_online<NG, 7>, attend_online<NG, 8>};
const AttendOnline* const ATTEND_ONLINE[4] = {BY_NB<1>, BY_NB<2>, BY_NB<3>, BY_NB<4>};

// One KV head of one row: its G query heads [G, D] against keys [t0, t1) of k [S, D], v [S, D] (D % 16 == 0) into
// out [G, D]: one pass per few heads (attend_online) where D <= 128, else all G heads' scores first (scores:
// scratch, resized to G rows of the span's keys), then the values.
void attend(const at::BFloat16* q, int64_t G, const at::BFloat16* k, const at::BFloat16* v, int64_t t0, int64_t t1,
            int64_t D, float scale, at::BFloat16* out, std::vector<float>& scores) {
  if (D <= 128) {
    const int64_t NB = D / 16, per_pass = heads_a_pass(NB);
    for (int64_t g = 0; g < G; g += per_pass) {
      const int64_t ng = std::min(per_pass, G - g);
      ATTEND_ONLINE[ng - 1][NB - 1](q + g * D, k, v, t0, t1, scale, out + g * D);
    }
    return;
  }
  const int64_t T = t1 - t0, stride = (T + KB - 1) / KB * KB;
  scores.resize(G * stride);
  std::vector<float> inv(G);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * stride;
    inv[g] = 1.f / exponentiate(s, T, score(q + g * D, k, t0, t1, D, scale, s));
  }
  for (int64_t g = 0; g < G; g += MAX_NG) {
    const int64_t ng = std::min<int64_t>(MAX_NG, G - g);
    for (int64_t d = 0; d < D; d += 16 * MAX_NB) {
      const int64_t nb = std::min<int64_t>(MAX_NB, (D - d) / 16);
      WEIGH_VALUES[ng - 1][nb - 1](scores.data() + g * stride, stride, inv.data() + g, v, t0, T, D, d, out + g * D);
    }
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
                  int64_t D, bool is_i8) {
  TORCH_CHECK((int64_t)k_caches.size() == R && (int64_t)v_caches.size() == R && (int64_t)pos.size() == R &&
              (int64_t)start.size() == R, "one cache, position and start per row");
  const auto dtype = is_i8 ? at::kChar : at::kBFloat16;
  for (int64_t r = 0; r < R; ++r) {
    const auto& kc = k_caches[r];
    TORCH_CHECK(kc.dim() == 4 && kc.size(0) == 1 && kc.size(1) == Hkv && kc.size(3) == D + (is_i8 ? 4 : 0) &&
                kc.is_contiguous() && kc.scalar_type() == dtype && v_caches[r].sizes() == kc.sizes() &&
                v_caches[r].is_contiguous() && v_caches[r].scalar_type() == dtype,
                "caches: contiguous bf16 [1, H_kv, S, D], or int8 [1, H_kv, S, D + 4], every one alike");
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
      attend(q, G, kc, vc, start[r], pos[r] + 1, D, scale, out + (r * H + h * G) * D, scores);
    }
  });
}

}  // namespace

torch::Tensor decode_attention_i8(const torch::Tensor& qkv, int64_t H, int64_t Hkv,
                                  const std::vector<torch::Tensor>& k_caches,
                                  const std::vector<torch::Tensor>& v_caches, const std::vector<int64_t>& pos,
                                  const std::vector<int64_t>& start, const c10::optional<torch::Tensor>& cos,
                                  const c10::optional<torch::Tensor>& sin);

torch::Tensor decode_attention(const torch::Tensor& qkv, int64_t H, int64_t Hkv,
                               const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                               const std::vector<int64_t>& pos, const std::vector<int64_t>& start,
                               const c10::optional<torch::Tensor>& cos, const c10::optional<torch::Tensor>& sin) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous(),
              "qkv: contiguous bf16 [R, (H + 2 H_kv) D]");
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && !k_caches.empty(), "H a multiple of H_kv, and rows");
  // 8-bit caches (kv_cache.py's kv_dtype int8) hold a position's D values and its 4-byte scale
  const bool is_i8 = k_caches[0].scalar_type() == at::kChar;
  const int64_t R = qkv.size(0), D = k_caches[0].size(-1) - (is_i8 ? 4 : 0), width = (H + 2 * Hkv) * D;
  TORCH_CHECK(D % 16 == 0 && qkv.size(1) == width, "D a multiple of 16, and qkv [R, (H + 2 H_kv) D]");
  check_caches(k_caches, v_caches, pos, start, R, Hkv, D, is_i8);
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin together");
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kBFloat16 && (*t)->is_contiguous() &&
                                    (*t)->dim() == 2 && (*t)->size(0) == R && (*t)->size(1) == D),
                "cos, sin: contiguous bf16 [R, D], each row's position");
  }
  if (is_i8) return decode_attention_i8(qkv, H, Hkv, k_caches, v_caches, pos, start, cos, sin);
  auto out = torch::empty({R, H, D}, qkv.options());
  const RowLayout in{qkv.data_ptr<at::BFloat16>(), width, 0, H * D, (H + Hkv) * D};
  run(in, R, H, Hkv, D, k_caches, v_caches, pos, start, cos ? cos->data_ptr<at::BFloat16>() : nullptr,
      sin ? sin->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>());
  return out;
}
