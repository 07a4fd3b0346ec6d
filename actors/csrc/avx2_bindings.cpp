// The actors' AVX2 CPU kernels as one Python extension (actors/cpu_kernels.py builds and loads it where the CPU
// has AVX2 and FMA but no AVX512-BF16: an fp32 model over bf16 weights).
#include <torch/extension.h>

#include <vector>

#include "decode_layers.h"

torch::Tensor bf16_weight_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                 const c10::optional<torch::Tensor>& bias);
torch::Tensor rms_norm_f32(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor decode_attention_f32(const torch::Tensor& qkv, int64_t H, int64_t Hkv,
                                   const std::vector<torch::Tensor>& k_caches,
                                   const std::vector<torch::Tensor>& v_caches, const std::vector<int64_t>& pos,
                                   const std::vector<int64_t>& start, const c10::optional<torch::Tensor>& cos,
                                   const c10::optional<torch::Tensor>& sin);

// The kernels decode_layers.h's layer loop calls: fp32 rows over bf16 weights.
struct Avx2Kernels {
  static constexpr at::ScalarType dtype = at::kFloat;
  static torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                              const c10::optional<torch::Tensor>& bias) {
    return bf16_weight_linear(x, packed, N, bias);
  }
  static torch::Tensor linear_add(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                  const c10::optional<torch::Tensor>& bias, const torch::Tensor& residual) {
    return residual + bf16_weight_linear(x, packed, N, bias);
  }
  static torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
    return rms_norm_f32(x, w, eps);
  }
  static constexpr auto attention = decode_attention_f32;
  // As MLP.forward computes fp32 rows: silu(gate) in place, times up in place; contiguous for the down projection.
  static torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t I) {
    torch::Tensor gate = gate_up.narrow(1, 0, I);
    at::silu_(gate).mul_(gate_up.narrow(1, I, I));
    return gate.contiguous();
  }
};

// Built with OpenMP, as the AVX512 kernels (bindings.cpp): at::parallel_for then uses torch's intra-op threads.
bool is_parallel() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("is_parallel", &is_parallel, "the kernels split their work over torch's intra-op threads");
  m.def("bf16_weight_linear", &bf16_weight_linear,
        "x [M, K] fp32 @ W.T (+ bias) with bf16 W packed as [N/16, K, 16] int16", NoGil(),
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none());
  m.def("rms_norm_f32", &rms_norm_f32, "RMSNorm of fp32 rows over their last dimension in one pass", NoGil(),
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("decode_attention_f32", &decode_attention_f32,
        "every decoding fp32 row's new key and value cached, and its query attended", NoGil(),
        pybind11::arg("qkv"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("k_caches"),
        pybind11::arg("v_caches"), pybind11::arg("pos"), pybind11::arg("start"), pybind11::arg("cos") = pybind11::none(),
        pybind11::arg("sin") = pybind11::none());
  decode_layers::bind<Avx2Kernels>(m);
}
