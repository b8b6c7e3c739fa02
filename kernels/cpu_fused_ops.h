// What the fused CPU ops share: scalar helpers with one rounding each (cpu_bf16_ops.cpp and
// cpu_paged_attention.cpp must compute exp and bf16 conversions alike), and paged attention's entry
// point for decoder_stack.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace specd_cpu {

inline float f32(c10::BFloat16 v) { return static_cast<float>(v); }
inline float round_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }

// exp(x) from arithmetic and bit operations only, so loops over it vectorise (std::exp does not,
// here): x = n ln2 + r, |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial (relative error
// under 2e-7), times 2^n through the exponent bits.
inline float vexp(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), name, " must be a CPU bfloat16 tensor");
}

// Attention of each new token over its keys in the paged cache (cpu_paged_attention.cpp).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& pos,
                           const c10::optional<at::Tensor>& key_index, double scale, int64_t window);

}  // namespace specd_cpu
