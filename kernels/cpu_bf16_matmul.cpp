// Batch-invariant bfloat16 matmul for CPU: y = x W^T + b (kernels/cpu_ops.py builds and loads it).
//
// Why not oneDNN: its kernels pick their K blocking from the row count. On an AMD EPYC (avx512_bf16,
// no AMX) a row computed alone (M = 1, a decode) and the same row inside a 5-row verify block or a
// prefill chunk differ in the last bit for K > 1024 (the down projection), so greedy output changed
// with batching and speculation. Here every output element is one float32 accumulator that runs
// over K in pair order (k = 0,1 then 2,3, ...), whatever the number of rows, the tile shape or
// the thread count: a row's bits are the same in any step, by construction.
//
// The weight is packed once at load (pack_linear_weight) into blocks of 16 output columns x K pairs,
// [ceil(N/16), ceil(K/2), 16, 2], so one 64-byte load holds the pair (k, k+1) of 16 columns:
// the operand layout of AVX512-BF16's vdpbf16ps. CPUs without it (AVX-512 only) widen the pair to
// float32 and take two FMAs in the same order.
#include "cpu_bf16_matmul.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace specd_cpu {
namespace {

using bf16 = at::BFloat16;
constexpr int64_t LANES = 16;  // output columns per packed block
constexpr int64_t PREFETCH = 16;  // pairs ahead

// SPECD_CPU_BF16_DOT=0 takes the FMA path on CPUs with AVX512-BF16 too (tests cover both paths).
bool has_avx512_bf16() {
  static const bool yes = [] {
    const char* env = std::getenv("SPECD_CPU_BF16_DOT");
    return __builtin_cpu_supports("avx512bf16") && !(env && std::string(env) == "0");
  }();
  return yes;
}

// x's pair (k, k+1) as one 32-bit value, broadcast to 16 lanes; odd K's last pair has k + 1 = 0.
inline __m512i pair(const bf16* x) {
  int32_t bits;
  std::memcpy(&bits, x, 4);
  return _mm512_set1_epi32(bits);
}

inline __m512i last_pair(const bf16* x) {
  uint16_t bits;
  std::memcpy(&bits, x, 2);
  return _mm512_set1_epi32(bits);
}

struct Dot {  // acc += x_k w_k + x_k+1 w_k+1 per lane, in one instruction
  // Inline assembly, not the intrinsic: the intrinsic needs the whole caller compiled for
  // AVX512-BF16, which would let the compiler use it elsewhere on CPUs without it.
  static inline __m512 step(__m512 acc, __m512i x, __m512i w) {
    asm("vdpbf16ps %[w], %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(x), [w] "v"(w));
    return acc;
  }
};

struct Fma {  // the same pair as two float32 FMAs, k then k + 1
  static inline __m512 step(__m512 acc, __m512i x, __m512i w) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                          _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x, high)),
                           _mm512_castsi512_ps(_mm512_and_si512(w, high)), acc);
  }
};

// 16 outputs (the first `valid`) as float32, or rounded to nearest even as torch's float -> bfloat16.
inline void store(__m512 v, int64_t valid, __mmask16 mask, bf16* y, float* yf) {
  if (yf) {
    _mm512_mask_storeu_ps(yf, mask, v);
    return;
  }
  alignas(64) float tmp[LANES];
  _mm512_store_ps(tmp, v);
  for (int64_t l = 0; l < valid; ++l) y[l] = bf16(tmp[l]);
}

// R rows x C column blocks of the output: R * C accumulators in registers, each over all of K.
template <class Op, int R, int C>
void tile(
    const bf16* x, int64_t ldx, const bf16* w, int64_t pairs, int64_t K, const float* bias, int64_t n0, int64_t N,
    bf16* y, int64_t ldy, float* yf) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t block = pairs * 2 * LANES;  // one column block's elements
  auto step = [&](int64_t p, auto broadcast) __attribute__((always_inline)) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = _mm512_loadu_si512(w + c * block + p * 2 * LANES);
      _mm_prefetch(reinterpret_cast<const char*>(w + c * block + (p + PREFETCH) * 2 * LANES), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = broadcast(x + r * ldx + 2 * p);
      for (int c = 0; c < C; ++c) acc[r][c] = Op::step(acc[r][c], xv, wv[c]);
    }
  };
  for (int64_t p = 0; p < K / 2; ++p) step(p, pair);
  if (K % 2) step(K / 2, last_pair);
  // Fully unrolled (no early exit), so the accumulators stay in registers through the loop above.
  for (int c = 0; c < C; ++c) {
    const int64_t n = n0 + c * LANES;
    const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(LANES, N - n));
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store(_mm512_add_ps(acc[r][c], b), valid, mask, y ? y + r * ldy + n : nullptr,
                                      yf ? yf + r * ldy + n : nullptr);
  }
}

// Rows in groups of R (the last group smaller), each group over the same column tile.
template <class Op, int R, int C>
void rows_tile(int64_t rows, const bf16* x, int64_t ldx, const bf16* w, int64_t pairs, int64_t K, const float* bias,
               int64_t n0, int64_t N, bf16* y, int64_t ldy, float* yf) {
  for (; rows > 0; rows -= R, x += R * ldx, y = y ? y + R * ldy : y, yf = yf ? yf + R * ldy : yf) {
    if (rows >= R) {
      tile<Op, R, C>(x, ldx, w, pairs, K, bias, n0, N, y, ldy, yf);
    } else if constexpr (R > 1) {
      rows_tile<Op, R - 1, C>(rows, x, ldx, w, pairs, K, bias, n0, N, y, ldy, yf);
      return;
    }
  }
}

// `blocks` column blocks from n0 (at most 8): as tiles of 8, 4, 2 and 1 blocks, so no load
// reaches past the weight's last block.
template <class Op, int R>
void column_tiles(int64_t blocks, int64_t rows, const bf16* x, int64_t ldx, const bf16* w, int64_t pairs, int64_t K,
                  const float* bias, int64_t n0, int64_t N, bf16* y, float* yf) {
  for (int64_t done = 0; done < blocks;) {
    const int64_t left = blocks - done, n = n0 + done * LANES;
    const bf16* wt = w + done * pairs * 2 * LANES;
    if (left >= 8 && R <= 2) {
      rows_tile<Op, R, 8>(rows, x, ldx, wt, pairs, K, bias, n, N, y, N, yf);
      done += 8;
    } else if (left >= 4) {
      rows_tile<Op, R, 4>(rows, x, ldx, wt, pairs, K, bias, n, N, y, N, yf);
      done += 4;
    } else if (left >= 2) {
      rows_tile<Op, R, 2>(rows, x, ldx, wt, pairs, K, bias, n, N, y, N, yf);
      done += 2;
    } else {
      rows_tile<Op, R, 1>(rows, x, ldx, wt, pairs, K, bias, n, N, y, N, yf);
      done += 1;
    }
  }
}

template <class Op>
void matmul(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, bf16* y, float* yf) {
  const int64_t pairs = (K + 1) / 2, blocks = (N + LANES - 1) / LANES;
  // Tile shapes change only the speed: each output's accumulation order is fixed above.
  // One or two rows (decode): 8 column blocks per tile keep enough FMAs in flight to stream W.
  // More (verify blocks, prefill): 6 rows x 4 column blocks. Work items are (column tile, chunk of
  // 48 rows), tile-major, so a thread's next item reads the same W tile from cache, not memory.
  const int64_t C = M <= 2 ? 8 : 4, tiles = (blocks + C - 1) / C, chunk = 48;
  const int64_t chunks = (M + chunk - 1) / chunk;
  at::parallel_for(0, tiles * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / chunks, r0 = (i % chunks) * chunk, rows = std::min(chunk, M - r0);
      const int64_t cols = std::min(C, blocks - t * C);
      const bf16* wt = w + t * C * pairs * 2 * LANES;
      bf16* yt = y ? y + r0 * N : nullptr;
      float* yft = yf ? yf + r0 * N : nullptr;
      if (C == 8) {
        column_tiles<Op, 2>(cols, rows, x + r0 * K, K, wt, pairs, K, bias, t * C * LANES, N, yt, yft);
      } else {
        column_tiles<Op, 6>(cols, rows, x + r0 * K, K, wt, pairs, K, bias, t * C * LANES, N, yt, yft);
      }
    }
  });
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "weight must be a 2-D CPU bfloat16 tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t blocks = (N + LANES - 1) / LANES, pairs = (K + 1) / 2;
  auto padded = at::zeros({blocks * LANES, pairs * 2}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [blocks, 16, pairs, 2] -> [blocks, pairs, 16, 2]
  return padded.view({blocks, LANES, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features, bool float_out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be a CPU bfloat16 tensor");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == LANES &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed must come from pack_linear_weight");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(packed.size(1) == (K + 1) / 2 && packed.size(0) == (N + LANES - 1) / LANES,
              "x's last dim or out_features does not match the packed weight");
  auto xc = x.contiguous();
  const int64_t M = xc.numel() / std::max<int64_t>(K, 1);
  auto shape = xc.sizes().vec();
  shape.back() = N;
  auto y = at::empty(shape, xc.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias must have out_features elements");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  bf16* yp = float_out ? nullptr : y.data_ptr<bf16>();
  float* yfp = float_out ? y.data_ptr<float>() : nullptr;
  if (M == 0) return y;
  if (has_avx512_bf16()) {
    matmul<Dot>(xc.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), N, bp, yp, yfp);
  } else {
    matmul<Fma>(xc.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), N, bp, yp, yfp);
  }
  return y;
}

}  // namespace specd_cpu

TORCH_LIBRARY_FRAGMENT(specd_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features, bool float_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd_cpu, CPU, m) {
  m.impl("pack_linear_weight", &specd_cpu::pack_linear_weight);
  m.impl("linear", &specd_cpu::linear);
}
