// Every decoder layer of a step in which each row decodes one token, in one call from Python: the step's ~12
// kernel and ATen calls a layer are made from C++, where in Python each paid the interpreter's and nn.Module's
// overhead. The same kernels and ATen ops in the same order as actors/model.py's layers with packed weights
// (bf16_linear.Fused, the decode-attention kernel): the same bits (tests/runtime/test_decode_layers.py).
//
// A template over the extension's kernels (`Kernels`: linear, linear_add (a residual added to the product), norm,
// attention, silu_mul and the dtype they compute in), instantiated by bindings.cpp (bf16 rows, AVX512-BF16) and
// avx2_bindings.cpp (fp32 rows over bf16 weights). The bf16 kernels add the residual and compute the activation
// in their own passes, with torch's bits for its ops (but for results below fp32's normal range, which their
// conversion flushes to 0).
//
// x: [R, hidden], one token a row; k_caches[l][r], v_caches[l][r]: layer l's cache of row r, [1, H_kv, S_r, D];
// pos, start, cos, sin: as the attention kernel takes them. Returns x after the last layer, [R, hidden].
#pragma once
#include <torch/extension.h>

#include <vector>

namespace decode_layers {

using Optional = c10::optional<torch::Tensor>;

inline void check_layers(const std::vector<torch::Tensor>& t, size_t L, const char* name) {
  TORCH_CHECK(t.size() == L, name, ": one per layer");
  for (const auto& w : t) TORCH_CHECK(w.defined(), name, ": a tensor per layer");
}

template <typename Kernels>
class DecodeLayers {
 public:
  // Per layer: the two norms' weights [hidden], and the packed projections with their biases (None where absent):
  // q, k and v joined [(H + 2 H_kv) D / 16, hidden / 2, 16]; o; gate and up joined; down.
  DecodeLayers(std::vector<torch::Tensor> input_norms, std::vector<torch::Tensor> post_norms,
               std::vector<torch::Tensor> qkv, std::vector<Optional> qkv_bias, std::vector<torch::Tensor> o,
               std::vector<Optional> o_bias, std::vector<torch::Tensor> gate_up, std::vector<Optional> gate_up_bias,
               std::vector<torch::Tensor> down, std::vector<Optional> down_bias, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps)
      : input_norms_(std::move(input_norms)), post_norms_(std::move(post_norms)), qkv_(std::move(qkv)),
        qkv_bias_(std::move(qkv_bias)), o_(std::move(o)), o_bias_(std::move(o_bias)), gate_up_(std::move(gate_up)),
        gate_up_bias_(std::move(gate_up_bias)), down_(std::move(down)), down_bias_(std::move(down_bias)),
        H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), hidden_(hidden), I_(intermediate), eps_(eps) {
    const size_t L = input_norms_.size();
    TORCH_CHECK(L > 0 && H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0 && D_ % 16 == 0, "layers, heads and head_dim");
    for (const auto* t : {&post_norms_, &qkv_, &o_, &gate_up_, &down_}) check_layers(*t, L, "weights");
    for (const auto* b : {&qkv_bias_, &o_bias_, &gate_up_bias_, &down_bias_}) {
      TORCH_CHECK(b->size() == L, "biases: one entry (or None) per layer");
    }
  }

  int64_t num_layers() const { return (int64_t)input_norms_.size(); }

  torch::Tensor run(torch::Tensor x, const std::vector<std::vector<torch::Tensor>>& k_caches,
                    const std::vector<std::vector<torch::Tensor>>& v_caches, const std::vector<int64_t>& pos,
                    const std::vector<int64_t>& start, const Optional& cos, const Optional& sin) const {
    const int64_t L = num_layers();
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == Kernels::dtype && x.is_contiguous(),
                "x: contiguous [R, hidden] in the kernels' dtype");
    TORCH_CHECK((int64_t)k_caches.size() == L && (int64_t)v_caches.size() == L, "caches: one list per layer");
    const int64_t R = x.size(0);
    for (int64_t l = 0; l < L; ++l) {
      // As DecoderLayer.forward: h = x + attention(norm(x)); x = h + mlp(norm(h)).
      const torch::Tensor qkv = Kernels::linear(Kernels::norm(x, input_norms_[l], eps_), qkv_[l],
                                                (H_ + 2 * Hkv_) * D_, qkv_bias_[l]);
      const torch::Tensor y = Kernels::attention(qkv, H_, Hkv_, k_caches[l], v_caches[l], pos, start, cos, sin);
      const torch::Tensor h = Kernels::linear_add(y.view({R, H_ * D_}), o_[l], hidden_, o_bias_[l], x);
      // As MLP.forward with gate and up joined: silu(gate) * up, then down.
      const torch::Tensor gate_up = Kernels::linear(Kernels::norm(h, post_norms_[l], eps_), gate_up_[l], 2 * I_,
                                                    gate_up_bias_[l]);
      x = Kernels::linear_add(Kernels::silu_mul(gate_up, I_), down_[l], hidden_, down_bias_[l], h);
    }
    return x;
  }

 private:
  std::vector<torch::Tensor> input_norms_, post_norms_, qkv_;
  std::vector<Optional> qkv_bias_;
  std::vector<torch::Tensor> o_;
  std::vector<Optional> o_bias_;
  std::vector<torch::Tensor> gate_up_;
  std::vector<Optional> gate_up_bias_;
  std::vector<torch::Tensor> down_;
  std::vector<Optional> down_bias_;
  int64_t H_, Hkv_, D_, hidden_, I_;
  double eps_;
};

template <typename Kernels>
void bind(pybind11::module& m) {
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  using Layers = DecodeLayers<Kernels>;
  pybind11::class_<Layers>(m, "DecodeLayers")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<Optional>, std::vector<torch::Tensor>, std::vector<Optional>,
                          std::vector<torch::Tensor>, std::vector<Optional>, std::vector<torch::Tensor>,
                          std::vector<Optional>, int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def_property_readonly("num_layers", &Layers::num_layers)
      .def("run", &Layers::run, "every layer of a decode-only step: x [R, hidden] -> x after the last", NoGil(),
           pybind11::arg("x"), pybind11::arg("k_caches"), pybind11::arg("v_caches"), pybind11::arg("pos"),
           pybind11::arg("start"), pybind11::arg("cos") = pybind11::none(), pybind11::arg("sin") = pybind11::none());
}

}  // namespace decode_layers
