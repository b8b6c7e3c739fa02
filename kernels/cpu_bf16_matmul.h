// kernels/cpu_bf16_matmul.cpp's and cpu_quant_matmul.cpp's entry points, for the other fused ops
// (decoder_stack) to call.
#pragma once
#include <ATen/ATen.h>

namespace specd_cpu {
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features, bool float_out);
// y = x W^T + b on a packed GGUF-quantized weight (a uint8 tensor from specd.engine.model.quant).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        bool float_out);
}  // namespace specd_cpu
