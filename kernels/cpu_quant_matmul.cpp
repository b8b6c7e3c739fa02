// Matmuls on GGUF's packed quantized weights, for CPU: y = x W^T + b, W as llama.cpp stores it
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks, row after row), never dequantized in memory.
// kernels/cpu_ops.py builds it with the bfloat16 ops; specd/engine/model/quant.py packs the weights.
//
// The arithmetic, as llama.cpp's CPU path does it: each row of x is quantized to 8 bits (scale
// max|x| / 127, round to nearest even) per group of 32 for the 32-weight types, of 256 for the
// k-quants, and each 32 weights' dot product with it is an exact integer sum. What makes it
// batch-invariant is the order: per output element, eight float32 lanes (lane j holds the products
// of k = 4j .. 4j+3 of each block of 32) accumulate block after block, acc_j = fma(weight scale x
// activation scale, integer sum_j, acc_j), then sum in one fixed tree, and a float32 term for the
// types with a minimum (w = scale q + min: min x activation scale x sum of the block's quantized x)
// runs beside them in block order. The k-quants apply their 6-bit sub-block scales in integers first
// (one fma per 256 weights, llama.cpp's way: 1.7-2x faster than a float step per 32). A row's result
// depends on that row and W only, whatever the row count, tile or thread count. The AVX-512 path
// (two blocks of 32 per register), the AVX2 path and the portable one (SPECD_QUANT_PORTABLE=1, what
// a CPU without AVX2 would run) compute exactly that, bit for bit (tests/kernels/test_cpu_quant_matmul.py,
// test_isa_builds.py), and dequantize_rows gives the gguf package's float32 values. Blocks of 5-16
// rows (verify blocks, prefill) on AVX-512 take many-row kernels that unpack each weight block once
// for all of them and compute the same bits ("verify blocks", below); the AVX2 build's kernels take up
// to 9 rows a pass for the same reason (SIMD_ROWS). On a CPU with AMX-INT8, Q4_K and
// Q6_K take kernels/cpu_quant_amx.cpp instead, for every row count: tile products, one float
// accumulator per output, bits of their own (SPECD_CPU_AMX=0 keeps the paths here).
//
// A packed weight is one uint8 tensor: a header of int64 (magic, K, N, segments, then per segment:
// GGML type, rows, byte offset, bytes per row) and the segments' rows, each segment's offset aligned
// to 64. Segments let a fused projection (q, k, v; gate, up) keep each part's own type.
//
// One file (about 1,300 lines) on purpose: its paths (portable, AVX2, AVX-512 1-4 rows, the many-row
// kernels) must give the same bits, so they share the block decoders (Q<T>), the activations'
// quantization and the float order in one translation unit, where a change to one is read beside the
// others; test_isa_builds.py builds this unit per ISA and compares the bits.
#include "cpu_bf16_matmul.h"
#include "cpu_quant_amx.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace specd_quant {
namespace {

using bf16 = c10::BFloat16;
constexpr int64_t MAGIC = 0x51445053;  // "SPDQ"
constexpr int64_t HEADER = 4, PER_SEGMENT = 4;

// GGML type ids (ggml.h).
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // the same value as the conversion below, in one instruction
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// One block of 32 weights, as the kernels see it: 32 integers (signed types: the weight is scale x q;
// unsigned: scale x q + min) and the scales of its two halves (equal except Q6_K, whose scales
// cover 16 weights).
struct Sub {
  float lo, hi, min;
};

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
inline void k4_scale_min(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Per type: BLOCK weights in BYTES bytes, SUBS blocks of 32 inside; subs() decodes the scales of all
// of them, values() the 32 integers of one (scalar; kernels below have the AVX2 forms).
template <int T> struct Q;

template <> struct Q<Q8_0> {
  static constexpr int BLOCK = 32, BYTES = 34, SUBS = 1;
  static constexpr bool SIGNED = true;
  static void subs(const uint8_t* b, Sub* s) { s[0] = {half_at(b), half_at(b), 0.0f}; }
  static void values(const uint8_t* b, int, int8_t* v) { std::memcpy(v, b + 2, 32); }
};
template <> struct Q<Q4_0> {
  static constexpr int BLOCK = 32, BYTES = 18, SUBS = 1;
  static constexpr bool SIGNED = true;
  static void subs(const uint8_t* b, Sub* s) { s[0] = {half_at(b), half_at(b), 0.0f}; }
  static void values(const uint8_t* b, int, int8_t* v) {
    for (int l = 0; l < 16; ++l) {
      v[l] = static_cast<int8_t>((b[2 + l] & 0xF) - 8);
      v[l + 16] = static_cast<int8_t>((b[2 + l] >> 4) - 8);
    }
  }
};
template <> struct Q<Q4_1> {
  static constexpr int BLOCK = 32, BYTES = 20, SUBS = 1;
  static constexpr bool SIGNED = false;
  static void subs(const uint8_t* b, Sub* s) { s[0] = {half_at(b), half_at(b), half_at(b + 2)}; }
  static void values(const uint8_t* b, int, int8_t* v) {
    for (int l = 0; l < 16; ++l) {
      v[l] = static_cast<int8_t>(b[4 + l] & 0xF);
      v[l + 16] = static_cast<int8_t>(b[4 + l] >> 4);
    }
  }
};
inline uint32_t u32_at(const uint8_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}
template <> struct Q<Q5_0> {
  static constexpr int BLOCK = 32, BYTES = 22, SUBS = 1;
  static constexpr bool SIGNED = true;
  static void subs(const uint8_t* b, Sub* s) { s[0] = {half_at(b), half_at(b), 0.0f}; }
  static void values(const uint8_t* b, int, int8_t* v) {
    const uint32_t qh = u32_at(b + 2);
    for (int l = 0; l < 16; ++l) {
      v[l] = static_cast<int8_t>(((b[6 + l] & 0xF) | (((qh >> l) & 1) << 4)) - 16);
      v[l + 16] = static_cast<int8_t>(((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16);
    }
  }
};
template <> struct Q<Q5_1> {
  static constexpr int BLOCK = 32, BYTES = 24, SUBS = 1;
  static constexpr bool SIGNED = false;
  static void subs(const uint8_t* b, Sub* s) { s[0] = {half_at(b), half_at(b), half_at(b + 2)}; }
  static void values(const uint8_t* b, int, int8_t* v) {
    const uint32_t qh = u32_at(b + 4);
    for (int l = 0; l < 16; ++l) {
      v[l] = static_cast<int8_t>((b[8 + l] & 0xF) | (((qh >> l) & 1) << 4));
      v[l + 16] = static_cast<int8_t>((b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
    }
  }
};
// The k-quants' integer scales, for the kernels' integer path: per 16 weights (Q4_K/Q5_K repeat each
// sub-block's), the sub-blocks' mins, and the block's d and dmin.
struct KScales {
  int16_t sc[16];
  int32_t m[8];
  float d, dmin;
};
inline void k4_scales(const uint8_t* b, KScales& k) {
  // k4_scale_min for all eight at once, four bytes per word: sc 0-3 and m 0-3 are the low 6 bits
  // of bytes 0-3 and 4-7; sc 4-7 and m 4-7 the nibbles of bytes 8-11, with bits 6-7 of bytes 0-3
  // and 4-7 as their bits 4-5.
  uint32_t u[3];
  std::memcpy(u, b + 4, 12);
  const uint32_t words[4] = {u[0] & 0x3f3f3f3fu, (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u),
                             u[1] & 0x3f3f3f3fu, ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)};
  uint8_t bytes[16];
  std::memcpy(bytes, words, 16);
  for (int j = 0; j < 8; ++j) {
    k.sc[2 * j] = k.sc[2 * j + 1] = bytes[j];
    k.m[j] = bytes[8 + j];
  }
  k.d = half_at(b);
  k.dmin = half_at(b + 2);
}

// Q4_K: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: sub-block 2j the
// low nibbles of bytes 32j .. 32j+31, 2j+1 their high nibbles; w = d sc q - dmin m.
template <> struct Q<Q4_K> {
  static constexpr int BLOCK = 256, BYTES = 144, SUBS = 8;
  static constexpr bool SIGNED = false;
  static void kscales(const uint8_t* b, KScales& k) { k4_scales(b, k); }
  static void subs(const uint8_t* b, Sub* s) {
    const float d = half_at(b), dmin = half_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k4_scale_min(j, b + 4, sc, m);
      s[j] = {d * sc, d * sc, -(dmin * m)};
    }
  }
  static void values(const uint8_t* b, int j, int8_t* v) {
    const uint8_t* q = b + 16 + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) v[l] = static_cast<int8_t>(j % 2 ? q[l] >> 4 : q[l] & 0xF);
  }
};
// Q5_K: as Q4_K, plus 32 bytes of high bits (bit j of byte l for sub-block j) before the nibbles.
template <> struct Q<Q5_K> {
  static constexpr int BLOCK = 256, BYTES = 176, SUBS = 8;
  static constexpr bool SIGNED = false;
  static void subs(const uint8_t* b, Sub* s) { Q<Q4_K>::subs(b, s); }
  static void kscales(const uint8_t* b, KScales& k) { k4_scales(b, k); }
  static void values(const uint8_t* b, int j, int8_t* v) {
    const uint8_t *qh = b + 16, *q = b + 48 + 32 * (j / 2);
    for (int l = 0; l < 32; ++l)
      v[l] = static_cast<int8_t>((j % 2 ? q[l] >> 4 : q[l] & 0xF) | (((qh[l] >> j) & 1) << 4));
  }
};
// Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 weights), d (fp16).
// In each half of 128 weights, sub-block t takes the low (t < 2) or high nibbles of bytes 32 (t % 2)
// .. +31 and bits 2t, 2t+1 of the highs; w = d sc (q - 32).
template <> struct Q<Q6_K> {
  static constexpr int BLOCK = 256, BYTES = 210, SUBS = 8;
  static constexpr bool SIGNED = true;
  static void subs(const uint8_t* b, Sub* s) {
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 8; ++j) s[j] = {d * sc[2 * j], d * sc[2 * j + 1], 0.0f};
  }
  static void kscales(const uint8_t* b, KScales& k) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int i = 0; i < 16; ++i) k.sc[i] = sc[i];
    for (int j = 0; j < 8; ++j) k.m[j] = 0;
    k.d = half_at(b + 208);
    k.dmin = 0.0f;
  }
  static void values(const uint8_t* b, int j, int8_t* v) {
    const int half = j / 4, t = j % 4;
    const uint8_t *ql = b + 64 * half + 32 * (t % 2), *qh = b + 128 + 32 * half;
    for (int l = 0; l < 32; ++l) {
      const int low = t < 2 ? ql[l] & 0xF : ql[l] >> 4;
      v[l] = static_cast<int8_t>((low | (((qh[l] >> (2 * t)) & 3) << 4)) - 32);
    }
  }
};

constexpr int GROUP_ROWS = 16;  // rows of x per pass of the many-row kernels (below)

// SPECD_QUANT_PORTABLE=1: the plain C++ path on an AVX2 build (tests compare the two).
bool portable() {
#if defined(__AVX2__)
  static const bool yes = [] {
    const char* env = std::getenv("SPECD_QUANT_PORTABLE");
    return env && std::string(env) == "1";
  }();
  return yes;
#else
  return true;
#endif
}

// Up to 16 rows of x (a group) as the many-row kernels take them (row_groups, below), per block of
// the group's size (32 or 256): dx2 [blocks][pairs][16] row 2p's scale in lanes 0-7, row 2p + 1's
// in 8-15; dxT [blocks][16] lane r row r's; xs the min terms' sums of 32: [blocks][16] for the
// 32-weight types, [blocks][4][16] for the k-quants as int16 pairs (sub-blocks 2j, 2j + 1), the form
// vpmaddwd multiplies by the mins.
struct RowGroup {
  int64_t r0 = 0;
  int rows = 0, pairs = 0;
  std::vector<float> dx2, dxT;
  std::vector<int32_t> xs;
  std::vector<int8_t> x;    // [pairs][K / 32][2][32]: rows 2p and 2p + 1, block after block
  std::vector<uint8_t> xu;  // the same, + 128
};

// x's rows quantized to int8 in groups of 32 (the 32-weight types) or 256 (the k-quants, whose
// integer scales then apply before one float step per block, as llama.cpp's Q8_K): per group the
// float32 scale, per 32 values their sum (the min terms).
struct QuantizedRows {
  int64_t K = 0, group = 32;
  // K / group, kept: drow() runs in the kernels' block loops, where computing K / group left a 64-bit
  // division in each block (the compiler did not hoist it): 1-row Q8_0 / Q5_0 took 2.5x / 1.75x the time
  // on a Zen 2 (bench/results/verify_rows_smollm2_q4km_epyc_avx2.md)
  int64_t groups_per_row = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum;
  std::vector<RowGroup> groups;  // where the many-row kernels run: the rows in their layouts
  specd_quant_amx::Rows amx;     // where Q4_K / Q6_K take the AMX path (cpu_quant_amx.cpp): its layouts
  const int8_t* qrow(int64_t r) const { return q.data() + r * K; }
  const float* drow(int64_t r) const { return d.data() + r * groups_per_row; }
  const int32_t* srow(int64_t r) const { return sum.data() + r * (K / 32); }
};

#if defined(__AVX2__)
// One group of x (n = 32 or 256 values), the scalar loop's arithmetic below (max |x|, d = max / 127,
// round(x / d) to nearest even), eight values at a time: decode quantizes x for every matmul.
inline void quantize_group_avx2(const bf16* xb, int64_t n, int8_t* q, float& d_out, int32_t* sums) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto widen = [&](int64_t i) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 8 * i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / 8; ++i) amax = _mm256_max_ps(amax, _mm256_and_ps(widen(i), abs_mask));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t c = 0; c < n / 32; ++c) {
    __m256i qi[4];
    __m256i total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(widen(4 * c + i), _mm256_set1_ps(id)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      total = _mm256_add_epi32(total, qi[i]);
    }
    // int32 -> int8 in k order: the packs interleave 128-bit lanes, the permute undoes it
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * c),
                        _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    sums[c] = _mm_cvtsi128_si32(t);
  }
  d_out = d;
}
#endif

QuantizedRows quantize_rows(const bf16* x, int64_t M, int64_t K, int64_t group) {
  QuantizedRows out;
  out.K = K;
  out.group = group;
  out.groups_per_row = K / group;
  out.q.resize(M * K);
  out.d.resize(M * out.groups_per_row);
  out.sum.resize(M * (K / 32));
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < out.groups_per_row; ++g) {
        const bf16* xb = x + r * K + g * group;
        int8_t* q = out.q.data() + r * K + g * group;
        int32_t* sums = out.sum.data() + (r * K + g * group) / 32;
        float& d_out = out.d[r * out.groups_per_row + g];
#if defined(__AVX2__)
        if (!portable()) {
          quantize_group_avx2(xb, group, q, d_out, sums);
          continue;
        }
#endif
        float amax = 0.0f;
        for (int64_t l = 0; l < group; ++l) amax = std::max(amax, std::fabs(static_cast<float>(xb[l])));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int64_t c = 0; c < group / 32; ++c) {
          int32_t s = 0;
          for (int l = 0; l < 32; ++l) {
            q[32 * c + l] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xb[32 * c + l]) * id));
            s += q[32 * c + l];
          }
          sums[c] = s;
        }
        d_out = d;
      }
    }
  });
  return out;
}

// The eight lanes summed in one fixed tree: (l + l+4), then (0 + 2) + (1 + 3), as the AVX2 reduction.
inline float reduce8(const float* a) {
  float t[4];
  for (int i = 0; i < 4; ++i) t[i] = a[i] + a[i + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// Portable: R rows of x against one weight row, the arithmetic of the header, in plain C++.
template <int T>
void dot_rows_portable(const uint8_t* w, const QuantizedRows& xq, int64_t r0, int R, float* out) {
  using QT = Q<T>;
  const int64_t nblk = xq.K / QT::BLOCK;
  float acc[8][8] = {}, macc[8] = {};
  Sub s[QT::SUBS];
  int8_t v[32];
  for (int64_t ib = 0; ib < nblk; ++ib) {
    const uint8_t* blk = w + ib * QT::BYTES;
    QT::subs(blk, s);
    for (int j = 0; j < QT::SUBS; ++j) {
      QT::values(blk, j, v);
      const int64_t b = ib * QT::SUBS + j;
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq.qrow(r0 + r) + b * 32;
        const float dx = xq.drow(r0 + r)[b];
        const float slo = s[j].lo * dx, shi = s[j].hi * dx;
        for (int lane = 0; lane < 8; ++lane) {
          int32_t p = 0;
          for (int t = 0; t < 4; ++t) p += static_cast<int32_t>(v[4 * lane + t]) * x[4 * lane + t];
          acc[r][lane] = std::fma(lane < 4 ? slo : shi, static_cast<float>(p), acc[r][lane]);
        }
        if (!QT::SIGNED) macc[r] = std::fma(s[j].min * dx, static_cast<float>(xq.srow(r0 + r)[b]), macc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce8(acc[r]) + macc[r];
}

// Portable, the k-quants: x in groups of 256. Per block, lane l sums over its 8 sub-blocks
// sc x (the integer products of k = 4l .. 4l+3) exactly in int32, then one fma with d x dx; the
// min term sums m_j x (sum of the sub-block's x) in int32, then one fma with -(dmin x dx).
template <int T>
void dot_k_portable(const uint8_t* w, const QuantizedRows& xq, int64_t r0, int R, float* out) {
  using QT = Q<T>;
  const int64_t nblk = xq.K / QT::BLOCK;
  float acc[8][8] = {}, macc[8] = {};
  KScales k;
  int8_t v[8][32];
  for (int64_t ib = 0; ib < nblk; ++ib) {
    const uint8_t* blk = w + ib * QT::BYTES;
    QT::kscales(blk, k);
    for (int j = 0; j < 8; ++j) QT::values(blk, j, v[j]);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq.qrow(r0 + r) + ib * 256;
      int32_t isum[8] = {}, msum = 0;
      for (int j = 0; j < 8; ++j) {
        for (int lane = 0; lane < 8; ++lane) {
          int32_t p = 0;
          for (int t = 0; t < 4; ++t) p += static_cast<int32_t>(v[j][4 * lane + t]) * x[32 * j + 4 * lane + t];
          isum[lane] += p * k.sc[2 * j + (lane >= 4)];
        }
        msum += k.m[j] * xq.srow(r0 + r)[ib * 8 + j];
      }
      const float dx = xq.drow(r0 + r)[ib];
      for (int lane = 0; lane < 8; ++lane) acc[r][lane] = std::fma(k.d * dx, static_cast<float>(isum[lane]), acc[r][lane]);
      if (!QT::SIGNED) macc[r] = std::fma(-(k.dmin * dx), static_cast<float>(msum), macc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce8(acc[r]) + macc[r];
}

#if defined(__AVX2__)
// The 32 integers of sub-block j in one register (bytes in k order).
inline __m256i nibbles16(const uint8_t* q) {  // 16 bytes -> low nibbles then high nibbles
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0xF));
}
inline __m256i bits32(uint32_t bits) {  // bit k -> byte k as 0xFF or 0
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i other_bits = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFELL);  // byte i: all bits but bit i
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, other_bits), _mm256_set1_epi64x(-1));
}
inline __m256i nibbles32(const uint8_t* q, bool high) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0xF));
}

template <int T> inline __m256i values_avx2(const uint8_t* b, int j);
template <> inline __m256i values_avx2<Q8_0>(const uint8_t* b, int) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
}
template <> inline __m256i values_avx2<Q4_0>(const uint8_t* b, int) {
  return _mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8));
}
template <> inline __m256i values_avx2<Q4_1>(const uint8_t* b, int) { return nibbles16(b + 4); }
template <> inline __m256i values_avx2<Q5_0>(const uint8_t* b, int) {
  const __m256i hi = _mm256_and_si256(bits32(u32_at(b + 2)), _mm256_set1_epi8(0x10));
  return _mm256_sub_epi8(_mm256_or_si256(nibbles16(b + 6), hi), _mm256_set1_epi8(16));
}
template <> inline __m256i values_avx2<Q5_1>(const uint8_t* b, int) {
  const __m256i hi = _mm256_and_si256(bits32(u32_at(b + 4)), _mm256_set1_epi8(0x10));
  return _mm256_or_si256(nibbles16(b + 8), hi);
}
template <> inline __m256i values_avx2<Q4_K>(const uint8_t* b, int j) { return nibbles32(b + 16 + 32 * (j / 2), j % 2); }
template <> inline __m256i values_avx2<Q5_K>(const uint8_t* b, int j) {
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
  const __m256i hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(0x10));
  return _mm256_or_si256(nibbles32(b + 48 + 32 * (j / 2), j % 2), hi);
}
// Q6_K's 6-bit values before the -32 offset (0 .. 63); values_avx2<Q6_K> subtracts it.
inline __m256i q6_unsigned_avx2(const uint8_t* b, int j) {
  const int half = j / 4, t = j % 4;
  const __m256i low = nibbles32(b + 64 * half + 32 * (t % 2), t >= 2);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
  // bits 2t, 2t+1 of each byte, moved to bits 4, 5 (16-bit shifts, then masked per byte)
  const __m256i shifted = 2 * t >= 4 ? _mm256_srli_epi16(qh, 2 * t - 4) : _mm256_slli_epi16(qh, 4 - 2 * t);
  return _mm256_or_si256(low, _mm256_and_si256(shifted, _mm256_set1_epi8(0x30)));
}
template <> inline __m256i values_avx2<Q6_K>(const uint8_t* b, int j) {
  return _mm256_sub_epi8(q6_unsigned_avx2(b, j), _mm256_set1_epi8(32));
}

// R rows of x against one weight row, in AVX2: the integer sums of 4 products per lane, then the
// lane-wise fma of the header; bit-identical to dot_rows_portable.
constexpr int64_t PREFETCH_BYTES = 1024;

inline float reduce8_avx2(__m256 a) {  // reduce8's tree: (l + l+4), then (0 + 2) + (1 + 3)
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// One block of 32 (block b of a row) of a 32-weight type against R rows: the integer sums of 4
// products per lane, then the lane-wise fma of the header.
template <int T, int R>
inline void block32_avx2(const uint8_t* blk, int64_t b, const QuantizedRows& xq, int64_t r0, __m256* acc, float* macc) {
  using QT = Q<T>;
  static_assert(QT::SUBS == 1, "the 32-weight types");
  Sub s[1];
  QT::subs(blk, s);
  const __m256i v = values_avx2<T>(blk, 0);
  const __m256i vu = QT::SIGNED ? _mm256_sign_epi8(v, v) : v;  // |v| for the signed types
  for (int r = 0; r < R; ++r) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.qrow(r0 + r) + b * 32));
    const float dx = xq.drow(r0 + r)[b];
    // x's sign follows v's for the signed types: |v| x sign(v) = v x
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(vu, QT::SIGNED ? _mm256_sign_epi8(x, v) : x),
                                        _mm256_set1_epi16(1));
    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s[0].lo * dx), _mm256_cvtepi32_ps(p), acc[r]);
    if (!QT::SIGNED) macc[r] = std::fma(s[0].min * dx, static_cast<float>(xq.srow(r0 + r)[b]), macc[r]);
  }
}

// The weights stream from memory once per step: ask for them ahead (into the next rows near a row's
// end), as the bf16 kernel does; without it decode read ~10 GB/s, a third of the bf16 path's.
template <int T> inline void prefetch_ahead(const uint8_t* blk, int blocks = 1) {
  const char* ahead = reinterpret_cast<const char*>(blk) + PREFETCH_BYTES;
  for (int line = 0; line < blocks * Q<T>::BYTES; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// R rows' float state in the 1-4 row kernels: the eight lanes of the header and the min term beside
// them, summed as the header says at the end.
template <int R> struct RowAccumulators {
  __m256 acc[R];
  float macc[R];
  RowAccumulators() {
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      macc[r] = 0.0f;
    }
  }
  void store(float* out, int64_t ldo) const {
    for (int r = 0; r < R; ++r) out[r * ldo] = reduce8_avx2(acc[r]) + macc[r];
  }
};

template <int T, int R>
void dot_tile_avx2(const uint8_t* w, const QuantizedRows& xq, int64_t r0, float* out, int64_t ldo) {
  using QT = Q<T>;
  RowAccumulators<R> a;
  for (int64_t ib = 0; ib < xq.K / QT::BLOCK; ++ib) {
    const uint8_t* blk = w + ib * QT::BYTES;
    prefetch_ahead<T>(blk);
    block32_avx2<T, R>(blk, ib, xq, r0, a.acc, a.macc);
  }
  a.store(out, ldo);
}

// A k-quant block's integer scales in registers (AVX2): sc holds, per 128-bit lane, the int16 scales
// that lane's half of a sub-block takes, sub-block j in element j (Q4_K / Q5_K: lane 0 = lane 1 =
// sc_j; Q6_K: lane 0 = sc_2j, lane 1 = sc_2j+1); m the eight mins as int32 (zero for Q6_K). The same
// integers as kscales() writes to KScales, unpacked with a few vector ops instead of a scalar loop.
struct KScalesAvx2 {
  __m256i sc, m;
  float d, dmin;
};
inline void k4_scales_avx2(const uint8_t* b, KScalesAvx2& k) {
  uint32_t u[3];
  std::memcpy(u, b + 4, 12);
  // k4_scales' words: bytes 0-7 the scales, 8-15 the mins
  const __m128i bytes = _mm_setr_epi32(static_cast<int>(u[0] & 0x3f3f3f3fu),
                                       static_cast<int>((u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u)),
                                       static_cast<int>(u[1] & 0x3f3f3f3fu),
                                       static_cast<int>(((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)));
  k.sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(bytes));
  k.m = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
  k.d = half_at(b);
  k.dmin = half_at(b + 2);
}
template <int T> inline void kscales_avx2(const uint8_t* b, KScalesAvx2& k) { k4_scales_avx2(b, k); }
template <> inline void kscales_avx2<Q6_K>(const uint8_t* b, KScalesAvx2& k) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const __m128i even_odd = _mm_shuffle_epi8(raw, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  k.sc = _mm256_cvtepi8_epi16(even_odd);  // lane 0: sc_0, sc_2, ..; lane 1: sc_1, sc_3, ..
  k.m = _mm256_setzero_si256();
  k.d = half_at(b + 208);
  k.dmin = 0.0f;
}
// Element j of each 128-bit lane's int16s, broadcast within the lane.
template <int J> inline __m256i lane_element16(__m256i v) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<int16_t>((2 * J) | ((2 * J + 1) << 8))));
}
inline int32_t sum8_epi32(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(t);
}

template <int T, int J, int R>
inline void k_sub_avx2(const uint8_t* blk, const __m256i sc, const QuantizedRows& xq, int64_t r0, int64_t ib,
                       __m256i* isum) {
  if constexpr (T == Q6_K) {
    // (q - 32) x in pairs as q x - 32 x: both fit maddubs' int16 (63 * 127 * 2, 32 * 127 * 2) and the
    // pairs equal the signed path's exactly, for one instruction less than taking signs.
    const __m256i qu = q6_unsigned_avx2(blk, J), offset = _mm256_set1_epi8(32);
    const __m256i s = lane_element16<J>(sc);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.qrow(r0 + r) + ib * 256 + 32 * J));
      const __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(qu, x), _mm256_maddubs_epi16(offset, x));
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16, s));
    }
    return;
  }
  const __m256i v = values_avx2<T>(blk, J);
  const __m256i vu = Q<T>::SIGNED ? _mm256_sign_epi8(v, v) : v;
  const __m256i s = lane_element16<J>(sc);
  for (int r = 0; r < R; ++r) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.qrow(r0 + r) + ib * 256 + 32 * J));
    const __m256i p16 = _mm256_maddubs_epi16(vu, Q<T>::SIGNED ? _mm256_sign_epi8(x, v) : x);
    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16, s));
  }
}

#if defined(SPECD_AVX512)
// AVX-512: two blocks of 32 (two consecutive blocks of the 32-weight types, two sub-blocks of a
// k-quant block) in one 512-bit register, the products and their sums in half as many instructions
// as the AVX2 path (bench/results/quant_avx512.md: 1.06-1.10x its decode on the 32-weight types, no
// gain on the k-quants, whose unpacking stays in 256-bit halves). What reaches the floats is the
// same: the 32-weight types convert the two blocks' eight lane sums and take the AVX2 path's two fmas
// in block order; the k-quants add the two halves' integer sums (exact in any order) before the
// block's one fma. So every result is the AVX2 path's, bit for bit (tests/kernels/test_isa_builds.py,
// test_cpu_quant_matmul.py).
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m256i high_half(__m512i v) { return _mm512_extracti64x4_epi64(v, 1); }

// The unsigned-times-signed byte products take |v| and x with v's sign for the signed types (as
// the AVX2 path's _mm256_sign_epi8, which AVX-512 lacks).
template <bool SIGNED> inline __m512i magnitude(__m512i v) { return SIGNED ? _mm512_abs_epi8(v) : v; }
template <bool SIGNED> inline __m512i with_sign_of(__m512i x, __m512i v) {
  return SIGNED ? _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(v), _mm512_setzero_si512(), x) : x;
}
// Products of pairs as int16 (maddubs), v x for the 32 bytes of each half.
template <bool SIGNED>
inline __m512i products16(__m512i v, __m512i x) {
  return _mm512_maddubs_epi16(magnitude<SIGNED>(v), with_sign_of<SIGNED>(x, v));
}

// Sub-blocks J and J+1 of a k-quant block against R rows: isum (16 int32 lanes; lane l and l + 8
// are summed at the block's end) gains sc x the products, k_sub_avx2's integers for both.
template <int T, int J, int R>
inline void k_pair_avx512(const uint8_t* blk, const __m256i sc, const QuantizedRows& xq, int64_t r0, int64_t ib,
                          __m512i* isum) {
  const __m512i s = join(lane_element16<J>(sc), lane_element16<J + 1>(sc));
  if constexpr (T == Q6_K) {  // (q - 32) x as q x - 32 x, as k_sub_avx2
    const __m512i qu = join(q6_unsigned_avx2(blk, J), q6_unsigned_avx2(blk, J + 1)), offset = _mm512_set1_epi8(32);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(xq.qrow(r0 + r) + ib * 256 + 32 * J);
      const __m512i p16 = _mm512_sub_epi16(_mm512_maddubs_epi16(qu, x), _mm512_maddubs_epi16(offset, x));
      isum[r] = _mm512_add_epi32(isum[r], _mm512_madd_epi16(p16, s));
    }
    return;
  }
  const __m512i v = join(values_avx2<T>(blk, J), values_avx2<T>(blk, J + 1));
  for (int r = 0; r < R; ++r) {
    const __m512i x = _mm512_loadu_si512(xq.qrow(r0 + r) + ib * 256 + 32 * J);
    isum[r] = _mm512_add_epi32(isum[r], _mm512_madd_epi16(products16<Q<T>::SIGNED>(v, x), s));
  }
}
#endif

// A k-quant block's integer sums against R rows, per lane l (0-7) sc x the products of k = 4l .. 4l+3
// over its 8 sub-blocks: AVX-512 takes the sub-blocks in pairs and adds the two halves at the end.
template <int T, int R>
inline void k_block_sums(const uint8_t* blk, const __m256i sc, const QuantizedRows& xq, int64_t r0, int64_t ib,
                         __m256i* isum) {
#if defined(SPECD_AVX512)
  __m512i wide[R];
  for (int r = 0; r < R; ++r) wide[r] = _mm512_setzero_si512();
  k_pair_avx512<T, 0, R>(blk, sc, xq, r0, ib, wide);
  k_pair_avx512<T, 2, R>(blk, sc, xq, r0, ib, wide);
  k_pair_avx512<T, 4, R>(blk, sc, xq, r0, ib, wide);
  k_pair_avx512<T, 6, R>(blk, sc, xq, r0, ib, wide);
  for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(_mm512_castsi512_si256(wide[r]), high_half(wide[r]));
#else
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
  k_sub_avx2<T, 0, R>(blk, sc, xq, r0, ib, isum);
  k_sub_avx2<T, 1, R>(blk, sc, xq, r0, ib, isum);
  k_sub_avx2<T, 2, R>(blk, sc, xq, r0, ib, isum);
  k_sub_avx2<T, 3, R>(blk, sc, xq, r0, ib, isum);
  k_sub_avx2<T, 4, R>(blk, sc, xq, r0, ib, isum);
  k_sub_avx2<T, 5, R>(blk, sc, xq, r0, ib, isum);
  k_sub_avx2<T, 6, R>(blk, sc, xq, r0, ib, isum);
  k_sub_avx2<T, 7, R>(blk, sc, xq, r0, ib, isum);
#endif
}

// The k-quants in AVX2 or AVX-512, dot_k_portable's arithmetic: the sub-blocks' scales applied in
// int16 x int16 -> int32 (madd), summed over the block in int32, one float fma per block. (Integer
// sums: their order does not change them, so vectorising the scales and mins kept every bit.)
template <int T, int R>
void dot_k_simd(const uint8_t* w, const QuantizedRows& xq, int64_t r0, float* out, int64_t ldo) {
  using QT = Q<T>;
  RowAccumulators<R> a;
  KScalesAvx2 k;
  for (int64_t ib = 0; ib < xq.K / QT::BLOCK; ++ib) {
    const uint8_t* blk = w + ib * QT::BYTES;
    prefetch_ahead<T>(blk);
    kscales_avx2<T>(blk, k);
    __m256i isum[R];
    k_block_sums<T, R>(blk, k.sc, xq, r0, ib, isum);
    for (int r = 0; r < R; ++r) {
      const float dx = xq.drow(r0 + r)[ib];
      a.acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(k.d * dx), _mm256_cvtepi32_ps(isum[r]), a.acc[r]);
      if (!QT::SIGNED) {
        const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.srow(r0 + r) + ib * 8));
        // m_j x xs_j in vpmaddwd (|xs_j| <= 32 x 127 fits int16; m_j's high half is 0): vpmulld's
        // products, in one uop instead of two
        const int32_t msum = sum8_epi32(_mm256_madd_epi16(k.m, xs));
        a.macc[r] = std::fma(-(k.dmin * dx), static_cast<float>(msum), a.macc[r]);
      }
    }
  }
  a.store(out, ldo);
}
#endif


#if defined(SPECD_AVX512)
// AVX512-VNNI's vpdpbusd sums the same 4 products per int32 lane in one instruction (the pairs of
// maddubs never saturate here: |v| <= 128, |x| <= 127), where the CPU has it; inline assembly, not
// the intrinsic, as for the bf16 dot product (cpu_bf16_matmul.cpp). SPECD_CPU_VNNI=0 turns it off.
bool has_avx512_vnni() {
#if defined(SPECD_EMULATE_AVX512)
  return false;
#else
  static const bool yes = __builtin_cpu_supports("avx512vnni") && !specd_simd::switched_off("SPECD_CPU_VNNI");
  return yes;
#endif
}

template <bool VNNI, bool SIGNED>
inline __m512i sums4(__m512i v, __m512i x, __m512i ones) {
  if constexpr (VNNI) {
    __m512i acc = _mm512_setzero_si512();
    const __m512i u = magnitude<SIGNED>(v), s = with_sign_of<SIGNED>(x, v);
#if !defined(SPECD_EMULATE_AVX512)
    asm("vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
#endif
    return acc;
  } else {
    return _mm512_madd_epi16(products16<SIGNED>(v, x), ones);
  }
}

template <int T, int R, bool VNNI>
void dot_tile_avx512(const uint8_t* w, const QuantizedRows& xq, int64_t r0, float* out, int64_t ldo) {
  using QT = Q<T>;
  static_assert(QT::SUBS == 1, "the 32-weight types");
  const int64_t nblk = xq.K / QT::BLOCK;
  const __m512i ones = _mm512_set1_epi16(1);
  RowAccumulators<R> a;
  __m256* acc = a.acc;
  float* macc = a.macc;
  Sub s0[1], s1[1];
  int64_t b = 0;
  for (; b + 2 <= nblk; b += 2) {
    const uint8_t* blk = w + b * QT::BYTES;
    prefetch_ahead<T>(blk, 2);
    QT::subs(blk, s0);
    QT::subs(blk + QT::BYTES, s1);
    const __m512i v = join(values_avx2<T>(blk, 0), values_avx2<T>(blk + QT::BYTES, 0));
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(xq.qrow(r0 + r) + b * 32);
      const float* dx = xq.drow(r0 + r) + b;
      const __m512i p = sums4<VNNI, QT::SIGNED>(v, x, ones);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s0[0].lo * dx[0]), _mm256_cvtepi32_ps(_mm512_castsi512_si256(p)), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s1[0].lo * dx[1]), _mm256_cvtepi32_ps(high_half(p)), acc[r]);
      if (!QT::SIGNED) {
        const int32_t* xs = xq.srow(r0 + r) + b;
        macc[r] = std::fma(s0[0].min * dx[0], static_cast<float>(xs[0]), macc[r]);
        macc[r] = std::fma(s1[0].min * dx[1], static_cast<float>(xs[1]), macc[r]);
      }
    }
  }
  if (b < nblk) block32_avx2<T, R>(w + b * QT::BYTES, b, xq, r0, acc, macc);  // an odd last block
  a.store(out, ldo);
}

// ---------------------------------------------------------------- verify blocks (AVX-512)
// A verify block (k + 1 rows) or a prefill chunk: each weight block is unpacked once and used for up
// to 16 rows of x, two rows at a time in one register: x's rows are laid out in pairs (row a's 32
// values of a sub-block, then row b's), the weights' 32 repeated in both halves, so the integer
// sums land as row a's eight lanes then row b's, the layout the float step takes as it is. Per row
// and lane it is the 1-4 row kernels' arithmetic on the same integers and operands:
//  - k-quants: sc x (the products of 4 values) summed over the block in int32 (vpmaddubsw, then
//    vpmaddwd and an add, or AVX512-VNNI's vpdpwssd), one fma with d x dx per block; Q6_K's q - 32
//    against x + 128 (unsigned), from -128 x the block's sum of sc (q - 32) (row-independent, once
//    a block), instead of a second vpmaddubsw per row for the -32;
//  - the 32-weight types: with AVX512-VNNI one vpdpbusd per block for both rows, the signed types
//    taking x + 128 from -128 x the block's weight sums, instead of flipping x's signs per row;
//  - the min terms of a group's 16 rows in one register, lane r row r, in block order.
// No pair of products reaches 2^15 (|x| <= 127 and x + 128 <= 255 against |q - 32| <= 32; the
// k-quants' unsigned q <= 31), so every sum is exact and every result is the 1-4 row kernels', bit
// for bit, whatever the row count (tests/kernels/test_cpu_quant_matmul.py).
constexpr int64_t PAIR_BYTES = 64;  // one block of 32 of two rows

std::vector<RowGroup> row_groups(const QuantizedRows& xq, int64_t M) {
  const int64_t nb = xq.groups_per_row, subs = xq.group / 32, n32 = xq.K / 32;
  std::vector<RowGroup> out;
  for (int64_t r0 = 0; r0 < M; r0 += GROUP_ROWS) {
    RowGroup g;
    g.r0 = r0;
    g.rows = static_cast<int>(std::min<int64_t>(GROUP_ROWS, M - r0));
    g.pairs = (g.rows + 1) / 2;
    g.dx2.assign(nb * g.pairs * 16, 0.0f);
    g.dxT.assign(nb * 16, 0.0f);
    g.xs.assign(nb * (subs == 1 ? 1 : 4) * 16, 0);
    g.x.resize(g.pairs * n32 * PAIR_BYTES);
    g.xu.resize(g.x.size());
    for (int r = 0; r < 2 * g.pairs; ++r) {
      const int64_t row = r0 + std::min(r, g.rows - 1);  // a lone last row is its own pair
      const int8_t* q = xq.qrow(row);
      for (int64_t c = 0; c < n32; ++c) {
        const int64_t at = ((r / 2) * n32 + c) * PAIR_BYTES + 32 * (r % 2);
        std::memcpy(g.x.data() + at, q + 32 * c, 32);
        for (int l = 0; l < 32; ++l) g.xu[at + l] = static_cast<uint8_t>(q[32 * c + l]) ^ 0x80u;
      }
      if (r >= g.rows) continue;
      const float* d = xq.drow(row);
      const int32_t* s = xq.srow(row);
      for (int64_t b = 0; b < nb; ++b) {
        for (int l = 0; l < 8; ++l) g.dx2[(b * g.pairs + r / 2) * 16 + 8 * (r % 2) + l] = d[b];
        g.dxT[b * 16 + r] = d[b];
        if (subs == 1) {
          g.xs[b * 16 + r] = s[b];
        } else {
          for (int j = 0; j < 4; ++j)
            g.xs[(b * 4 + j) * 16 + r] = static_cast<int32_t>((static_cast<uint32_t>(s[8 * b + 2 * j]) & 0xFFFFu) |
                                                              (static_cast<uint32_t>(s[8 * b + 2 * j + 1]) << 16));
        }
      }
    }
    out.push_back(std::move(g));
  }
  return out;
}

// The integer steps, in 512-bit registers or, for a group's lone last row (an odd row count), in
// 256-bit ones with the same integers per lane. The 256-bit form is EVEX-encoded (AVX512-VNNI + VL),
// not AVX-VNNI's VEX form, which CPUs with AVX512-VNNI may lack.
template <class V>
inline V dpbusd(V acc, V u, V s) {  // acc += u8 x s8, 4 products a lane
#if !defined(SPECD_EMULATE_AVX512)
  if constexpr (sizeof(V) == 64) asm("vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
  else asm("%{evex%} vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
#endif
  return acc;
}
// acc += the int16 pairs of p x those of s, summed per lane: vpdpwssd, or vpmaddwd and an add.
template <bool VNNI, class V>
inline V add_madd(V acc, V p, V s) {
  if constexpr (VNNI) {
#if !defined(SPECD_EMULATE_AVX512)
    if constexpr (sizeof(V) == 64) asm("vpdpwssd %[s], %[p], %[acc]" : [acc] "+v"(acc) : [p] "v"(p), [s] "v"(s));
    else asm("%{evex%} vpdpwssd %[s], %[p], %[acc]" : [acc] "+v"(acc) : [p] "v"(p), [s] "v"(s));
#endif
    return acc;
  } else if constexpr (sizeof(V) == 64) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
  }
}
inline __m512i both_halves(__m256i v) { return join(v, v); }
inline __m512 to_float(__m512i v) {  // int32 -> float32 per lane
#if defined(SPECD_EMULATE_AVX512)  // (SIMDe 0.7.4 has no 512-bit form: two 256-bit ones, the same values)
  const __m256 lo = _mm256_cvtepi32_ps(_mm512_castsi512_si256(v)), hi = _mm256_cvtepi32_ps(high_half(v));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
#else
  return _mm512_cvtepi32_ps(v);
#endif
}

// Row r's result: its eight lanes in reduce8's tree, plus its min term.
inline void store_rows(const __m512* acc, __m512 macc, int rows, float* out, int64_t ldo) {
  alignas(64) float mins[16];
  _mm512_store_ps(mins, macc);
  for (int r = 0; r < rows; ++r) {
    const __m512d a = _mm512_castps_pd(acc[r / 2]);
    const __m256 half = _mm256_castpd_ps(r % 2 ? _mm512_extractf64x4_pd(a, 1) : _mm512_castpd512_pd256(a));
    out[r * ldo] = reduce8_avx2(half) + mins[r];
  }
}

inline __m256i low256(__m512i v) { return _mm512_castsi512_si256(v); }

// Blocks b0 .. b1 of one weight row of a k-quant against a group's rows (dot_k_simd's arithmetic),
// carrying on from state: P pairs of rows, then L (0 or 1) lone row, then the min terms. The
// counts are template arguments so the sums stay in registers (in memory each block's fma waited
// on the last one's store: 2 rows of Q8_0 took 2.5x the time of the 1-4 row kernel), and a lone
// row takes 256-bit operations, not a pair's work (3 rows of Q4_K took 1.3x the time of 2 rows).
template <int T, bool VNNI, int P, int L>
void k_rows_avx512(const uint8_t* w, int64_t b0, int64_t b1, const QuantizedRows& xq, const RowGroup& g,
                   __m512* state) {
  using QT = Q<T>;
  constexpr int PP = P + L;  // (the layouts' pairs)
  const int64_t n32 = xq.K / 32;
  __m512 acc[PP];
  for (int p = 0; p < PP; ++p) acc[p] = state[p];
  __m256 lone = _mm512_castps512_ps256(acc[PP - 1]);
  __m512 macc = state[PP];
  KScalesAvx2 k;
  const uint8_t* end = w + b1 * QT::BYTES;  // (the span's: the next one is read after the other rows')
  for (int64_t ib = b0; ib < b1; ++ib) {
    const uint8_t* blk = w + ib * QT::BYTES;
    if (blk + PREFETCH_BYTES < end)
      for (int line = 0; line < QT::BYTES; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk) + PREFETCH_BYTES + line, _MM_HINT_T0);
    kscales_avx2<T>(blk, k);
    __m512i v[8], s[8];
#define SPECD_SUB(J) v[J] = both_halves(values_avx2<T>(blk, J)), s[J] = both_halves(lane_element16<J>(k.sc));
    SPECD_SUB(0) SPECD_SUB(1) SPECD_SUB(2) SPECD_SUB(3) SPECD_SUB(4) SPECD_SUB(5) SPECD_SUB(6) SPECD_SUB(7)
#undef SPECD_SUB
    __m512i start = _mm512_setzero_si512();
    if constexpr (T == Q6_K) {  // q - 32 against x + 128: start from -128 x the sum of sc (q - 32)
      for (int j = 0; j < 8; ++j)
        start = add_madd<VNNI>(start, _mm512_maddubs_epi16(_mm512_set1_epi8(static_cast<char>(0x80)), v[j]), s[j]);
      start = _mm512_sub_epi32(_mm512_setzero_si512(), start);
    }
    const __m512 d = _mm512_set1_ps(k.d);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const int64_t at = (p * n32 + ib * 8) * PAIR_BYTES;
      __m512i isum = start;
      for (int j = 0; j < 8; ++j) {
        const __m512i p16 = T == Q6_K ? _mm512_maddubs_epi16(_mm512_loadu_si512(g.xu.data() + at + j * PAIR_BYTES), v[j])
                                      : _mm512_maddubs_epi16(v[j], _mm512_loadu_si512(g.x.data() + at + j * PAIR_BYTES));
        isum = add_madd<VNNI>(isum, p16, s[j]);
      }
      const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps(g.dx2.data() + (ib * PP + p) * 16));
      acc[p] = _mm512_fmadd_ps(scale, to_float(isum), acc[p]);
    }
    if constexpr (L == 1) {
      const int64_t at = (P * n32 + ib * 8) * PAIR_BYTES;
      __m256i isum = low256(start);
      for (int j = 0; j < 8; ++j) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            (T == Q6_K ? reinterpret_cast<const char*>(g.xu.data()) : reinterpret_cast<const char*>(g.x.data())) + at +
            j * PAIR_BYTES));
        const __m256i p16 = T == Q6_K ? _mm256_maddubs_epi16(x, low256(v[j])) : _mm256_maddubs_epi16(low256(v[j]), x);
        isum = add_madd<VNNI>(isum, p16, low256(s[j]));
      }
      const __m256 scale = _mm256_mul_ps(_mm512_castps512_ps256(d), _mm256_loadu_ps(g.dx2.data() + (ib * PP + P) * 16));
      lone = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), lone);
    }
    if constexpr (!QT::SIGNED) {  // sum_j m_j (x's sum of sub-block j), 16 rows a register
      const __m128i m16 = _mm_packs_epi32(_mm256_castsi256_si128(k.m), _mm256_extracti128_si256(k.m, 1));
      const int32_t* xs = g.xs.data() + ib * 64;  // int32 j of m16: (m_2j, m_2j+1)
      __m512i msum = _mm512_setzero_si512();
      msum = add_madd<VNNI>(msum, _mm512_loadu_si512(xs), _mm512_set1_epi32(_mm_extract_epi32(m16, 0)));
      msum = add_madd<VNNI>(msum, _mm512_loadu_si512(xs + 16), _mm512_set1_epi32(_mm_extract_epi32(m16, 1)));
      msum = add_madd<VNNI>(msum, _mm512_loadu_si512(xs + 32), _mm512_set1_epi32(_mm_extract_epi32(m16, 2)));
      msum = add_madd<VNNI>(msum, _mm512_loadu_si512(xs + 48), _mm512_set1_epi32(_mm_extract_epi32(m16, 3)));
      const __m512 mscale = _mm512_mul_ps(_mm512_set1_ps(-k.dmin), _mm512_loadu_ps(g.dxT.data() + ib * 16));
      macc = _mm512_fmadd_ps(mscale, to_float(msum), macc);
    }
  }
  for (int p = 0; p < P; ++p) state[p] = acc[p];
  if constexpr (L == 1) state[P] = _mm512_castps256_ps512(lone);
  state[PP] = macc;
}

// The same for a 32-weight type (dot_tile_avx512's arithmetic).
template <int T, bool VNNI, int P, int L>
void b32_rows_avx512(const uint8_t* w, int64_t b0, int64_t b1, const QuantizedRows& xq, const RowGroup& g,
                     __m512* state) {
  using QT = Q<T>;
  static_assert(QT::SUBS == 1, "the 32-weight types");
  constexpr int PP = P + L;
  const int64_t nblk = xq.K / QT::BLOCK;
  const __m512i ones = _mm512_set1_epi16(1);
  __m512 acc[PP];
  for (int p = 0; p < PP; ++p) acc[p] = state[p];
  __m256 lone = _mm512_castps512_ps256(acc[PP - 1]);
  __m512 macc = state[PP];
  const uint8_t* end = w + b1 * QT::BYTES;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = w + b * QT::BYTES;
    if (blk + PREFETCH_BYTES < end) _mm_prefetch(reinterpret_cast<const char*>(blk) + PREFETCH_BYTES, _MM_HINT_T0);
    Sub s[1];
    QT::subs(blk, s);
    const __m512i v = both_halves(values_avx2<T>(blk, 0));
    __m512i start = _mm512_setzero_si512();
    if constexpr (VNNI && QT::SIGNED)
      start = _mm512_sub_epi32(start, dpbusd(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), v));
    const __m512 scale = _mm512_set1_ps(s[0].lo);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const int64_t at = (p * nblk + b) * PAIR_BYTES;
      __m512i sums;
      if constexpr (VNNI && QT::SIGNED) sums = dpbusd(start, _mm512_loadu_si512(g.xu.data() + at), v);
      else if constexpr (VNNI) sums = dpbusd(start, v, _mm512_loadu_si512(g.x.data() + at));
      else sums = _mm512_madd_epi16(products16<QT::SIGNED>(v, _mm512_loadu_si512(g.x.data() + at)), ones);
      const __m512 sx = _mm512_mul_ps(scale, _mm512_loadu_ps(g.dx2.data() + (b * PP + p) * 16));
      acc[p] = _mm512_fmadd_ps(sx, to_float(sums), acc[p]);
    }
    if constexpr (L == 1) {
      const int64_t at = (P * nblk + b) * PAIR_BYTES;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.x.data() + at));
      const __m256i xu = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.xu.data() + at)), v1 = low256(v);
      __m256i sums;
      if constexpr (VNNI && QT::SIGNED) sums = dpbusd(low256(start), xu, v1);
      else if constexpr (VNNI) sums = dpbusd(low256(start), v1, x);
      else if constexpr (QT::SIGNED)  // block32_avx2's sign trick
        sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(v1, v1), _mm256_sign_epi8(x, v1)),
                                 _mm256_set1_epi16(1));
      else sums = _mm256_madd_epi16(_mm256_maddubs_epi16(v1, x), _mm256_set1_epi16(1));
      const __m256 sx = _mm256_mul_ps(_mm512_castps512_ps256(scale), _mm256_loadu_ps(g.dx2.data() + (b * PP + P) * 16));
      lone = _mm256_fmadd_ps(sx, _mm256_cvtepi32_ps(sums), lone);
    }
    if constexpr (!QT::SIGNED)
      macc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(s[0].min), _mm512_loadu_ps(g.dxT.data() + b * 16)),
                             to_float(_mm512_loadu_si512(g.xs.data() + b * 16)), macc);
  }
  for (int p = 0; p < P; ++p) state[p] = acc[p];
  if constexpr (L == 1) state[P] = _mm512_castps256_ps512(lone);
  state[PP] = macc;
}

// f(std::integral_constant<int, P>, std::integral_constant<int, L>): a group's rows as P pairs and
// L lone rows.
template <class F>
void with_pairs(int rows, F&& f) {
  using std::integral_constant;
  switch (rows) {
    case 1: return f(integral_constant<int, 0>(), integral_constant<int, 1>());
    case 2: return f(integral_constant<int, 1>(), integral_constant<int, 0>());
    case 3: return f(integral_constant<int, 1>(), integral_constant<int, 1>());
    case 4: return f(integral_constant<int, 2>(), integral_constant<int, 0>());
    case 5: return f(integral_constant<int, 2>(), integral_constant<int, 1>());
    case 6: return f(integral_constant<int, 3>(), integral_constant<int, 0>());
    case 7: return f(integral_constant<int, 3>(), integral_constant<int, 1>());
    case 8: return f(integral_constant<int, 4>(), integral_constant<int, 0>());
    case 9: return f(integral_constant<int, 4>(), integral_constant<int, 1>());
    case 10: return f(integral_constant<int, 5>(), integral_constant<int, 0>());
    case 11: return f(integral_constant<int, 5>(), integral_constant<int, 1>());
    case 12: return f(integral_constant<int, 6>(), integral_constant<int, 0>());
    case 13: return f(integral_constant<int, 6>(), integral_constant<int, 1>());
    case 14: return f(integral_constant<int, 7>(), integral_constant<int, 0>());
    case 15: return f(integral_constant<int, 7>(), integral_constant<int, 1>());
    default: return f(integral_constant<int, 8>(), integral_constant<int, 0>());
  }
}

// `cols` weight rows (ldw bytes apart) against a group's rows -> out[rows][ldo]. In spans of K whose
// paired x stays in L1 (about 24 KB) for all the rows: a whole K of 9 rows was 90 KB of it at the
// down projection's 8960, read from L2 for each weight row, and no faster than 1-4 rows a pass.
template <int T, bool VNNI>
void rows_avx512(const uint8_t* w, int64_t ldw, int64_t cols, const QuantizedRows& xq, const RowGroup& g, float* out,
                 int64_t ldo) {
  using QT = Q<T>;
  const int64_t nblk = xq.K / QT::BLOCK, per = QT::BLOCK / 32;
  const int64_t span = std::max<int64_t>(1, 24576 / (g.pairs * PAIR_BYTES * per));
  std::vector<__m512> acc(cols * (g.pairs + 1), _mm512_setzero_ps());
  with_pairs(g.rows, [&](auto pairs, auto lone) {
    constexpr int P = decltype(pairs)::value, L = decltype(lone)::value;
    for (int64_t b0 = 0; b0 < nblk; b0 += span)
      for (int64_t c = 0; c < cols; ++c) {
        __m512* a = acc.data() + c * (g.pairs + 1);
        const int64_t b1 = std::min(nblk, b0 + span);
        if constexpr (QT::BLOCK == 256) k_rows_avx512<T, VNNI, P, L>(w + c * ldw, b0, b1, xq, g, a);
        else b32_rows_avx512<T, VNNI, P, L>(w + c * ldw, b0, b1, xq, g, a);
      }
  });
  for (int64_t c = 0; c < cols; ++c) {
    const __m512* a = acc.data() + c * (g.pairs + 1);
    store_rows(a, a[g.pairs], g.rows, out + c, ldo);
  }
}


#endif


constexpr int PORTABLE_ROWS = 4;  // rows of x per pass over the weight rows, the portable path
constexpr int64_t MANY_ROWS = 5;  // from this many rows on, the AVX-512 build takes the many-row kernels (2-4 rows were
// 2-23% slower there than in the 1-4 row kernels on a 2-core EPYC, Zen 5: bench/results/verify_rows_q4km_1p5b_epyc.md)
#if defined(SPECD_AVX512)
constexpr int SIMD_ROWS = 4;  // (blocks of 5+ rows take the many-row kernels)
#else
// AVX2 has no many-row kernels: a verify block of up to 9 rows (k + 1, k <= 8) in one pass, each weight
// block unpacked once for all its rows; a row's arithmetic is the same for any R, so its bits are too.
constexpr int SIMD_ROWS = 9;
#endif

// f(std::integral_constant<int, R>) for R = rows (1 .. MAX): the kernels take R as a template argument.
template <int MAX, int R = 1, class F>
void with_rows(int rows, F&& f) {
  if constexpr (R == MAX) {
    f(std::integral_constant<int, R>());
  } else {
    if (rows == R) return f(std::integral_constant<int, R>());
    with_rows<MAX, R + 1>(rows, f);
  }
}

// `cols` weight rows (ldw bytes apart) against all M rows of x -> out[M][ldo], columns 0 .. cols-1.
template <int T>
void dot_block(const uint8_t* w, int64_t ldw, int64_t cols, const QuantizedRows& xq, int64_t M, float* out,
               int64_t ldo) {
  if constexpr (T == Q4_K || T == Q6_K) {
    if (!xq.amx.groups.empty()) return specd_quant_amx::k_rows(T, w, ldw, cols, xq.amx, xq.K, out, ldo);
  }
#if defined(SPECD_AVX512)
  if (!xq.groups.empty()) {  // a verify block or more: each weight block once for up to 16 rows
    for (const RowGroup& g : xq.groups) {
      if (has_avx512_vnni()) rows_avx512<T, true>(w, ldw, cols, xq, g, out + g.r0 * ldo, ldo);
      else rows_avx512<T, false>(w, ldw, cols, xq, g, out + g.r0 * ldo, ldo);
    }
    return;
  }
#endif
  const int step = portable() ? PORTABLE_ROWS : SIMD_ROWS;
  for (int64_t r0 = 0; r0 < M; r0 += step) {
    const int R = static_cast<int>(std::min<int64_t>(step, M - r0));
    float* o = out + r0 * ldo;
#if defined(__AVX2__)
    if (!portable()) {
      // One weight row at a time: two or four interleaved rows (more fma chains in flight) streamed
      // the weights 1.2-1.9x slower at batch 1 on the AVX2 EPYC (bench: all of a Q8_0 model's matmuls).
      with_rows<SIMD_ROWS>(R, [&](auto r) {
        constexpr int RR = decltype(r)::value;
        for (int64_t c = 0; c < cols; ++c) {
          if constexpr (Q<T>::BLOCK == 256) dot_k_simd<T, RR>(w + c * ldw, xq, r0, o + c, ldo);
#if defined(SPECD_AVX512)
          else if (has_avx512_vnni()) dot_tile_avx512<T, RR, true>(w + c * ldw, xq, r0, o + c, ldo);
          else dot_tile_avx512<T, RR, false>(w + c * ldw, xq, r0, o + c, ldo);
#else
          else dot_tile_avx2<T, RR>(w + c * ldw, xq, r0, o + c, ldo);
#endif
        }
      });
      continue;
    }
#endif
    float tmp[PORTABLE_ROWS];
    for (int64_t c = 0; c < cols; ++c) {
      if constexpr (Q<T>::BLOCK == 256) dot_k_portable<T>(w + c * ldw, xq, r0, R, tmp);
      else dot_rows_portable<T>(w + c * ldw, xq, r0, R, tmp);
      for (int r = 0; r < R; ++r) o[r * ldo + c] = tmp[r];
    }
  }
}

struct Segment {
  int64_t type, rows, offset, row_bytes;
};

struct Packed {
  int64_t K, N;
  std::vector<Segment> segments;
  const uint8_t* base;
};

Packed parse(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= HEADER * 8,
              "packed must come from specd.engine.model.quant (a 1-D uint8 tensor)");
  const uint8_t* base = packed.data_ptr<uint8_t>();
  int64_t h[HEADER];
  std::memcpy(h, base, sizeof(h));
  TORCH_CHECK(h[0] == MAGIC, "packed quantized weight: bad header");
  Packed p{h[1], h[2], {}, base};
  int64_t rows = 0;
  for (int64_t i = 0; i < h[3]; ++i) {
    Segment s;
    std::memcpy(&s, base + (HEADER + PER_SEGMENT * i) * 8, sizeof(s));
    TORCH_CHECK(s.offset + s.rows * s.row_bytes <= packed.numel(), "packed quantized weight: segment past the end");
    p.segments.push_back(s);
    rows += s.rows;
  }
  TORCH_CHECK(rows == p.N, "packed quantized weight: segments do not add up to N");
  return p;
}

template <class F>
void by_type(int64_t type, F&& f) {
  switch (type) {
    case Q4_0: return f(std::integral_constant<int, Q4_0>());
    case Q4_1: return f(std::integral_constant<int, Q4_1>());
    case Q5_0: return f(std::integral_constant<int, Q5_0>());
    case Q5_1: return f(std::integral_constant<int, Q5_1>());
    case Q8_0: return f(std::integral_constant<int, Q8_0>());
    case Q4_K: return f(std::integral_constant<int, Q4_K>());
    case Q5_K: return f(std::integral_constant<int, Q5_K>());
    case Q6_K: return f(std::integral_constant<int, Q6_K>());
    default: TORCH_CHECK(false, "GGML type ", type, " has no quantized kernel");
  }
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        bool float_out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be a CPU bfloat16 tensor");
  const Packed p = parse(packed);
  TORCH_CHECK(p.K % 32 == 0, "K must be a multiple of 32");
  for (const Segment& s : p.segments) TORCH_CHECK(s.type < Q4_K || p.K % 256 == 0, "k-quant parts need K % 256 == 0");
  TORCH_CHECK(x.size(-1) == p.K, "x's last dim ", x.size(-1), " does not match the weight's K ", p.K);
  auto xc = x.contiguous();
  const int64_t M = xc.numel() / std::max<int64_t>(p.K, 1), N = p.N;
  auto shape = xc.sizes().vec();
  shape.back() = N;
  auto y = at::empty(shape, xc.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias must have N elements");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  // x in groups of 32 for the 32-weight types, of 256 for the k-quants: each only where a part needs it
  bool any32 = false, any256 = false;
  for (const Segment& s : p.segments) (s.type >= Q4_K ? any256 : any32) = true;
  QuantizedRows x32 = any32 ? quantize_rows(xc.data_ptr<bf16>(), M, p.K, 32) : QuantizedRows();
  QuantizedRows x256 = any256 ? quantize_rows(xc.data_ptr<bf16>(), M, p.K, 256) : QuantizedRows();
  // Q4_K and Q6_K on AMX-INT8: that path for every row count, with its own bits (cpu_quant_amx.cpp)
  bool amx_types = false, any_other_k = false;  // (Q5_K keeps the lane paths)
  for (const Segment& s : p.segments) {
    amx_types |= s.type == Q4_K || s.type == Q6_K;
    any_other_k |= s.type == Q5_K;
  }
  const bool amx = amx_types && !portable() && specd_quant_amx::usable();
  if (amx) x256.amx = specd_quant_amx::prepare(x256.q.data(), x256.d.data(), x256.sum.data(), M, p.K);
#if defined(SPECD_AVX512)
  if (M >= MANY_ROWS && !portable()) {
    for (QuantizedRows* xq : {&x32, &x256}) {
      if (xq->q.empty() || (xq == &x256 && amx && !any_other_k)) continue;
      xq->groups = row_groups(*xq, M);
    }
  }
#endif
  float* yf = float_out ? y.data_ptr<float>() : nullptr;
  bf16* yb = float_out ? nullptr : y.data_ptr<bf16>();
  // Work items: chunks of 16 output columns; each computes its columns for all rows, segment by
  // segment, in passes of SIMD_ROWS rows (PORTABLE_ROWS portable) over the same weight rows (in
  // cache). The split changes only the speed. A thread takes its chunks SPAN at a time, so its float32 results in flight are M x 256
  // (a 512-token prefill's gate_up held M x N / threads of them: 18 MB of peak resident size each).
  constexpr int64_t CHUNK = 16, SPAN = 16;
  at::parallel_for(0, (N + CHUNK - 1) / CHUNK, 1, [&](int64_t first, int64_t last) {
    std::vector<float> out;
    for (int64_t c0 = first; c0 < last; c0 += SPAN) {
      const int64_t n_begin = c0 * CHUNK, n_end = std::min(N, std::min(last, c0 + SPAN) * CHUNK);
      const int64_t ldo = n_end - n_begin;
      out.resize(M * ldo);
      int64_t seg_first = 0;
      for (const Segment& s : p.segments) {
        const int64_t lo = std::max(n_begin, seg_first), hi = std::min(n_end, seg_first + s.rows);
        if (lo < hi) {
          const uint8_t* w = p.base + s.offset + (lo - seg_first) * s.row_bytes;
          by_type(s.type, [&](auto t) {
            constexpr int T = decltype(t)::value;
            dot_block<T>(w, s.row_bytes, hi - lo, Q<T>::BLOCK == 256 ? x256 : x32, M, out.data() + (lo - n_begin), ldo);
          });
        }
        seg_first += s.rows;
      }
      for (int64_t r = 0; r < M; ++r)
        for (int64_t n = n_begin; n < n_end; ++n) {
          const float v = bp ? out[r * ldo + n - n_begin] + bp[n] : out[r * ldo + n - n_begin];
          if (yf) yf[r * N + n] = v;
          else yb[r * N + n] = bf16(v);
        }
    }
  });
  return y;
}

// Rows `ids` of the weight as float32 (the gguf package's values: scale x q + min): embeddings, and
// the reference for tests.
at::Tensor dequantize_rows(const at::Tensor& packed, const at::Tensor& ids) {
  const Packed p = parse(packed);
  auto idx = ids.to(at::kLong).contiguous();
  const int64_t T = idx.numel();
  auto out = at::empty({T, p.K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < T; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < p.N, "row ", ip[i], " out of range [0, ", p.N, ")");
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t row = ip[t];
      size_t si = 0;
      while (row >= p.segments[si].rows) row -= p.segments[si++].rows;
      const Segment& s = p.segments[si];
      const uint8_t* w = p.base + s.offset + row * s.row_bytes;
      by_type(s.type, [&](auto ty) {
        using QT = Q<decltype(ty)::value>;
        Sub sub[QT::SUBS];
        int8_t v[32];
        for (int64_t ib = 0; ib < p.K / QT::BLOCK; ++ib) {
          const uint8_t* blk = w + ib * QT::BYTES;
          QT::subs(blk, sub);
          for (int j = 0; j < QT::SUBS; ++j) {
            QT::values(blk, j, v);
            float* o = op + t * p.K + ib * QT::BLOCK + j * 32;
            for (int l = 0; l < 32; ++l) o[l] = (l < 16 ? sub[j].lo : sub[j].hi) * v[l] + sub[j].min;
          }
        }
      });
    }
  });
  return out;
}

}  // namespace
}  // namespace specd_quant

namespace specd_cpu {
// decoder_stack's matmuls take a packed quantized weight where the tensor is uint8.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        bool float_out) {
  return specd_quant::quant_linear(x, packed, bias, float_out);
}
}  // namespace specd_cpu

TORCH_LIBRARY_FRAGMENT(specd_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor packed, Tensor? bias, bool float_out=False) -> Tensor");
  m.def("quant_dequantize_rows(Tensor packed, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd_cpu, CPU, m) {
  m.impl("quant_linear", &specd_quant::quant_linear);
  m.impl("quant_dequantize_rows", &specd_quant::dequantize_rows);
}
