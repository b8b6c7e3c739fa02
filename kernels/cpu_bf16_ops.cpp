// Fused bfloat16 CPU ops for the decoder layer's small steps (kernels/cpu_ops.py builds and loads them).
//
// Why: at batch-1 decode on a 2-core CPU, SmolLM2-135M's matmuls take ~16 ms a token and the
// ~40 small torch ops per layer around them (norm, rotary, KV write, attention, SiLU) another
// ~10 ms, mostly per-op dispatch. Each op here replaces several of them (attention's is in
// cpu_paged_attention.cpp; this file registers every op).
//
// Every op is row-local with one fixed reduction order per output element, whatever the number of
// rows: a token's result is the same alone, in a verify block or in a batch (batch-invariant mode).
// Reductions use 16 partial sums (lane l takes elements l, l + 16, ...) folded in a fixed order:
// the compiler can vectorise that without reassociating anything.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_bf16_matmul.h"
#include "cpu_fused_ops.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

using namespace specd_simd;
using specd_cpu::check_bf16, specd_cpu::f32, specd_cpu::round_bf16, specd_cpu::vexp;
constexpr int L = LANES;

inline float fold(float* part) {
  for (int w = L / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

inline float sum_squares(const bf16* x, int64_t n) {
  float part[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int l = 0; l < L; ++l) part[l] += f32(x[i + l]) * f32(x[i + l]);
  for (int l = 0; i + l < n; ++l) part[l] += f32(x[i + l]) * f32(x[i + l]);
  return fold(part);
}

// transformers' LlamaRMSNorm in bf16: normalise in fp32, round to bf16, then times the bf16 weight.
void norm_row(const bf16* x, const bf16* w, bf16* y, int64_t n, double eps) {
  const float r = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) y[i] = bf16(f32(w[i]) * round_bf16(f32(x[i]) * r));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_bf16(x, "x");
  check_bf16(weight, "weight");
  const int64_t n = x.size(-1);
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto y = at::empty_like(xc);
  const int64_t rows = xc.numel() / n;
  const bf16 *xp = xc.data_ptr<bf16>(), *wp = wc.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * n, wp, yp + r * n, n, eps);
  });
  return y;
}

// (h, norm(h)) with h = x + residual rounded to bf16: the residual add and the next layer norm in one op.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_bf16(x, "x");
  check_bf16(residual, "residual");
  check_bf16(weight, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  const int64_t n = x.size(-1);
  auto xc = x.contiguous();
  auto rc = residual.contiguous();
  auto wc = weight.contiguous();
  auto h = at::empty_like(xc);
  auto y = at::empty_like(xc);
  const int64_t rows = xc.numel() / n;
  const bf16 *xp = xc.data_ptr<bf16>(), *rp = rc.data_ptr<bf16>(), *wp = wc.data_ptr<bf16>();
  bf16 *hp = h.data_ptr<bf16>(), *yp = y.data_ptr<bf16>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < n; ++i) hp[r * n + i] = bf16(f32(xp[r * n + i]) + f32(rp[r * n + i]));
      norm_row(hp + r * n, wp, yp + r * n, n, eps);
    }
  });
  return {h, y};
}

// silu(gate) * up with gate_up = [gate | up] on the last dim; each product rounded as torch does.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_bf16(gate_up, "gate_up");
  const int64_t n2 = gate_up.size(-1), n = n2 / 2;
  TORCH_CHECK(n2 % 2 == 0, "gate_up's last dim must be even");
  auto gc = gate_up.contiguous();
  auto shape = gc.sizes().vec();
  shape.back() = n;
  auto y = at::empty(shape, gc.options());
  const int64_t rows = gc.numel() / n2;
  const bf16* gp = gc.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  // Over elements, not rows: a decode step's one row of 8960 took 60 us on one thread.
  at::parallel_for(0, rows * n, 2048, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1;) {
      const int64_t r = e / n, end = std::min(e1, (r + 1) * n);
      const bf16 *gate = gp + r * n2 - r * n, *up = gate + n;  // indexed by e
      for (; e < end; ++e) {
        const float g = f32(gate[e]);
        yp[e] = bf16(round_bf16(g / (1.0f + vexp(-g))) * f32(up[e]));
      }
    }
  });
  return y;
}

// Rotary embedding (rotate-half, as transformers' Llama) of q and k in qkv [T, H + 2 Hkv, D], with
// torch's bf16 rounding of x*cos, rotated*sin and their sum; k and v are written to the paged
// cache [blocks, block_size, Hkv, D] at slots [T]. Returns the rotated q [T, H, D].
at::Tensor rotary_write_kv(const at::Tensor& qkv, int64_t num_heads, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  check_bf16(qkv, "qkv");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  const int64_t T = qkv.size(0), D = qkv.size(2), hkv = k_cache.size(2), half = D / 2;
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * hkv && k_cache.size(3) == D, "qkv does not match the cache's heads");
  auto qc = qkv.contiguous();
  auto cc = cos.reshape({T, D}).contiguous();
  auto sc = sin.reshape({T, D}).contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  auto q = at::empty({T, num_heads, D}, qkv.options());
  const bf16 *xp = qc.data_ptr<bf16>(), *cp = cc.data_ptr<bf16>(), *sp = sc.data_ptr<bf16>();
  bf16 *qp = q.data_ptr<bf16>(), *kp = k_cache.data_ptr<bf16>(), *vp = v_cache.data_ptr<bf16>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t width = num_heads + 2 * hkv, cache_slots = k_cache.numel() / (hkv * D);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slp[t] >= 0 && slp[t] < cache_slots, "cache slot ", slp[t], " out of range");
  // 64: a decode token's dozen heads are too little work to wake a second thread for.
  at::parallel_for(0, T * (num_heads + hkv), 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / (num_heads + hkv), h = i % (num_heads + hkv);
      const bf16* x = xp + (t * width + h) * D;
      const bf16 *c = cp + t * D, *s = sp + t * D;
      bf16* out = h < num_heads ? qp + (t * num_heads + h) * D : kp + (slp[t] * hkv + h - num_heads) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < half ? -f32(x[d + half]) : f32(x[d - half]);
        out[d] = bf16(round_bf16(f32(x[d]) * f32(c[d])) + round_bf16(rot * f32(s[d])));
      }
      if (h >= num_heads) {
        const bf16* v = xp + (t * width + h + hkv) * D;
        std::copy(v, v + D, vp + (slp[t] * hkv + h - num_heads) * D);
      }
    }
  });
  return q;
}

// Every decoder layer of a Llama-family model in one call: the same ops in the same order as
// CausalLM.forward's fused path (so the same bits), without ~10 Python calls per layer, which cost
// ~14% of a batch-1 decode step of the default target. weights holds, per layer, input norm, qkv,
// o, post-attention norm, gate_up, down (the matmul weights packed by pack_linear_weight, or uint8:
// GGUF-quantized, packed by specd/engine/model/quant.py); biases
// and out_features, per layer, for qkv, o, gate_up and down. Returns the residual stream after the last layer's attention and that layer's
// MLP output, left unadded as in the Python path.
std::tuple<at::Tensor, at::Tensor> decoder_stack(
    const at::Tensor& embeddings, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
    at::IntArrayRef out_features, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& pos,
    const c10::optional<at::Tensor>& key_index, int64_t num_heads, int64_t head_dim, double scale, int64_t window,
    double eps) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == 6 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers && static_cast<int64_t>(out_features.size()) == 4 * layers &&
                  static_cast<int64_t>(v_caches.size()) == layers,
              "decoder_stack wants 6 weights, 4 biases, 4 out_features and a K and V cache per layer");
  const int64_t T = embeddings.size(0);
  at::Tensor x = embeddings, y, mlp_out;
  for (int64_t j = 0; j < layers; ++j) {
    const at::Tensor* w = weights.data() + 6 * j;
    if (j == 0) {
      y = rms_norm(x, w[0], eps);
    } else {
      std::tie(x, y) = add_rms_norm(mlp_out, x, w[0], eps);
    }
    auto linear = [&](const at::Tensor& in, int m) {  // m: qkv, o, gate_up, down
      constexpr int weight_index[4] = {1, 2, 4, 5};
      const at::Tensor& weight = w[weight_index[m]];
      if (weight.scalar_type() == at::kByte) return specd_cpu::quant_linear(in, weight, biases.get(4 * j + m), false);
      return specd_cpu::linear(in, weight, biases.get(4 * j + m), out_features[4 * j + m], false);
    };
    auto qkv = linear(y, 0);
    auto q = rotary_write_kv(qkv.view({T, -1, head_dim}), num_heads, cos, sin, k_caches[j], v_caches[j], slots);
    auto attn = specd_cpu::paged_attention(q, k_caches[j], v_caches[j], block_tables, seq, pos, key_index, scale, window);
    auto a = linear(attn.view({T, num_heads * head_dim}), 1);
    std::tie(x, y) = add_rms_norm(a, x, w[3], eps);
    auto gate_up = linear(y, 2);
    mlp_out = linear(silu_mul(gate_up), 3);
  }
  return {x, mlp_out};
}

}  // namespace

TORCH_LIBRARY(specd_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_write_kv(Tensor qkv, int num_heads, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq, "
        "Tensor pos, Tensor? key_index, float scale, int window) -> Tensor");
  m.def("decoder_stack(Tensor embeddings, Tensor[] weights, Tensor?[] biases, int[] out_features, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, Tensor seq, "
        "Tensor pos, Tensor? key_index, int num_heads, int head_dim, float scale, int window, float eps) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specd_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_write_kv", &rotary_write_kv);
  m.impl("paged_attention", &specd_cpu::paged_attention);
  m.impl("decoder_stack", &decoder_stack);
}
