// The actors' CPU kernels as one Python extension (actors/cpu_kernels.py builds and loads it).
#include <torch/extension.h>

#include <vector>

#include "decode_layers.h"

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                          const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual);
torch::Tensor decode_attention(const torch::Tensor& qkv, int64_t H, int64_t Hkv,
                               const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                               const std::vector<int64_t>& pos, const std::vector<int64_t>& start,
                               const c10::optional<torch::Tensor>& cos, const c10::optional<torch::Tensor>& sin);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor argmax_rows(const torch::Tensor& logits);
torch::Tensor silu_mul(const torch::Tensor& gate_up);

// The kernels decode_layers.h's layer loop calls: bf16 rows.
struct Bf16Kernels {
  static constexpr at::ScalarType dtype = at::kBFloat16;
  static torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                              const c10::optional<torch::Tensor>& bias) {
    return bf16_linear(x, packed, N, bias, c10::nullopt);
  }
  // residual + linear(x): the add in the linear's own epilogue, no tensor of its own.
  static torch::Tensor linear_add(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                  const c10::optional<torch::Tensor>& bias, const torch::Tensor& residual) {
    return bf16_linear(x, packed, N, bias, residual);
  }
  static torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, double eps) { return rms_norm(x, w, eps); }
  static constexpr auto attention = decode_attention;
  static torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t) { return ::silu_mul(gate_up); }
};

// Built with OpenMP: at::parallel_for then splits a kernel over torch's intra-op threads (else it runs on one).
bool is_parallel() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

// The kernels let go of the GIL while they compute (their arguments are converted before, their results
// after): an actor's event loop, which streams the tokens of the step before, runs meanwhile instead of
// stalling the stepping thread at its next bytecode.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("is_parallel", &is_parallel, "the kernels split their work over torch's intra-op threads");
  m.def("bf16_linear", &bf16_linear,
        "x [M, K] bf16 @ W.T (+ bias) (+ residual [M, N]) with W packed as [N/16, K/2, 16] int32 pairs", NoGil(),
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("residual") = pybind11::none());
  m.def("decode_attention", &decode_attention, "every decoding row's new key and value cached, and its query attended",
        NoGil(),
        pybind11::arg("qkv"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("k_caches"),
        pybind11::arg("v_caches"), pybind11::arg("pos"), pybind11::arg("start"), pybind11::arg("cos") = pybind11::none(),
        pybind11::arg("sin") = pybind11::none());
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows over their last dimension, as HF computes it in bf16", NoGil(),
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest fp32 logit", NoGil(),
        pybind11::arg("logits"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up of bf16 [M, 2I] gate and up side by side: [M, I]", NoGil(),
        pybind11::arg("gate_up"));
  decode_layers::bind<Bf16Kernels>(m);
}
