// Matmuls on GGUF's packed quantized weights, for CPU: y = x W^T + b, W as llama.cpp stores it
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks, row after row), never dequantized in memory.
// kernels/cpu_ops.py builds it with the bfloat16 ops; specd/engine/quant.py packs the weights.
//
// The arithmetic, as llama.cpp's CPU path does it: each row of x is quantized to 8 bits per block of
// 32 (scale max|x| / 127, round to nearest even), and each 32 weights' dot product with it is an exact
// integer sum. What makes it batch-invariant is the order: per output element, eight float32 lanes
// (lane j holds the products of k = 4j .. 4j+3 of each block of 32) accumulate block after block,
// acc_j = fma(weight scale x activation scale, integer sum_j, acc_j), then sum in one fixed tree, and a
// float32 term for the types with a minimum (w = scale q + min: min x activation scale x sum of the
// block's quantized x) runs beside them in block order. A row's result depends on that row and W
// only, whatever the row count, tile or thread count. The AVX2 path and the portable one
// (SPECD_QUANT_PORTABLE=1, what a CPU without AVX2 would run) compute exactly that, bit for bit
// (tests/kernels/test_cpu_quant_matmul.py), and dequantize_rows gives the gguf package's float32 values.
//
// A packed weight is one uint8 tensor: a header of int64 (magic, K, N, segments, then per segment:
// GGML type, rows, byte offset, bytes per row) and the segments' rows, each segment's offset aligned
// to 64. Segments let a fused projection (q, k, v; gate, up) keep each part's own type.
#include "cpu_bf16_matmul.h"

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
// Q4_K: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: sub-block 2j the
// low nibbles of bytes 32j .. 32j+31, 2j+1 their high nibbles; w = d sc q - dmin m.
template <> struct Q<Q4_K> {
  static constexpr int BLOCK = 256, BYTES = 144, SUBS = 8;
  static constexpr bool SIGNED = false;
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
  static void values(const uint8_t* b, int j, int8_t* v) {
    const int half = j / 4, t = j % 4;
    const uint8_t *ql = b + 64 * half + 32 * (t % 2), *qh = b + 128 + 32 * half;
    for (int l = 0; l < 32; ++l) {
      const int low = t < 2 ? ql[l] & 0xF : ql[l] >> 4;
      v[l] = static_cast<int8_t>((low | (((qh[l] >> (2 * t)) & 3) << 4)) - 32);
    }
  }
};

// x's rows quantized per block of 32: int8 values, the float32 scale and the values' sum per block.
struct QuantizedRows {
  int64_t blocks;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum;
  const int8_t* qrow(int64_t r) const { return q.data() + r * blocks * 32; }
  const float* drow(int64_t r) const { return d.data() + r * blocks; }
  const int32_t* srow(int64_t r) const { return sum.data() + r * blocks; }
};

QuantizedRows quantize_rows(const bf16* x, int64_t M, int64_t K) {
  QuantizedRows out{K / 32, {}, {}, {}};
  out.q.resize(M * K);
  out.d.resize(M * out.blocks);
  out.sum.resize(M * out.blocks);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < out.blocks; ++b) {
        const bf16* xb = x + r * K + b * 32;
        float amax = 0.0f;
        for (int l = 0; l < 32; ++l) amax = std::max(amax, std::fabs(static_cast<float>(xb[l])));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int8_t* q = out.q.data() + (r * out.blocks + b) * 32;
        int32_t s = 0;
        for (int l = 0; l < 32; ++l) {
          q[l] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xb[l]) * id));
          s += q[l];
        }
        out.d[r * out.blocks + b] = d;
        out.sum[r * out.blocks + b] = s;
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
  const int64_t nblk = xq.blocks * 32 / QT::BLOCK;
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
template <> inline __m256i values_avx2<Q6_K>(const uint8_t* b, int j) {
  const int half = j / 4, t = j % 4;
  const __m256i low = nibbles32(b + 64 * half + 32 * (t % 2), t >= 2);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
  // bits 2t, 2t+1 of each byte, moved to bits 4, 5 (16-bit shifts, then masked per byte)
  const __m256i shifted = 2 * t >= 4 ? _mm256_srli_epi16(qh, 2 * t - 4) : _mm256_slli_epi16(qh, 4 - 2 * t);
  const __m256i hi = _mm256_and_si256(shifted, _mm256_set1_epi8(0x30));
  return _mm256_sub_epi8(_mm256_or_si256(low, hi), _mm256_set1_epi8(32));
}

// R rows of x against C weight rows, in AVX2: the integer sums of 4 products per lane, then the
// lane-wise fma of the header; bit-identical to dot_rows_portable.
constexpr int64_t PREFETCH_BYTES = 1024;

template <int T, int R, int C>
void dot_tile_avx2(const uint8_t* w, int64_t ldw, const QuantizedRows& xq, int64_t r0, float* out, int64_t ldo) {
  using QT = Q<T>;
  const int64_t nblk = xq.blocks * 32 / QT::BLOCK;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][C];
  float macc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      macc[r][c] = 0.0f;
    }
  Sub s[C][QT::SUBS];
  for (int64_t ib = 0; ib < nblk; ++ib) {
    // The weights stream from memory once per step: ask for them ahead (into the next rows near a
    // row's end), as the bf16 kernel does; without it decode read ~10 GB/s, a third of the bf16 path's.
    for (int c = 0; c < C; ++c) {
      const char* ahead = reinterpret_cast<const char*>(w + c * ldw + ib * QT::BYTES) + PREFETCH_BYTES;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      if (QT::BYTES > 128) _mm_prefetch(ahead + 128, _MM_HINT_T0);
      if (QT::BYTES > 192) _mm_prefetch(ahead + 192, _MM_HINT_T0);
    }
    for (int c = 0; c < C; ++c) QT::subs(w + c * ldw + ib * QT::BYTES, s[c]);
    for (int j = 0; j < QT::SUBS; ++j) {
      const int64_t b = ib * QT::SUBS + j;
      __m256i v[C], vu[C];
      for (int c = 0; c < C; ++c) {
        v[c] = values_avx2<T>(w + c * ldw + ib * QT::BYTES, j);
        vu[c] = QT::SIGNED ? _mm256_sign_epi8(v[c], v[c]) : v[c];  // |v| for the signed types
      }
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.qrow(r0 + r) + b * 32));
        const float dx = xq.drow(r0 + r)[b];
        for (int c = 0; c < C; ++c) {
          // x's sign follows v's for the signed types: |v| x sign(v) = v x
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(vu[c], QT::SIGNED ? _mm256_sign_epi8(x, v[c]) : x), ones);
          const __m256 scale = QT::SUBS == 8 && T == Q6_K
                                   ? _mm256_set_m128(_mm_set1_ps(s[c][j].hi * dx), _mm_set1_ps(s[c][j].lo * dx))
                                   : _mm256_set1_ps(s[c][j].lo * dx);
          acc[r][c] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc[r][c]);
          if (!QT::SIGNED) macc[r][c] = std::fma(s[c][j].min * dx, static_cast<float>(xq.srow(r0 + r)[b]), macc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r][c]);
      out[r * ldo + c] = reduce8(lanes) + macc[r][c];
    }
}
#endif

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

constexpr int ROWS = 4;  // rows of x per pass over the weight rows

// `cols` weight rows (ldw bytes apart) against all M rows of x -> out[M][ldo], columns 0 .. cols-1.
template <int T>
void dot_block(const uint8_t* w, int64_t ldw, int64_t cols, const QuantizedRows& xq, int64_t M, float* out,
               int64_t ldo) {
  for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
    const int R = static_cast<int>(std::min<int64_t>(ROWS, M - r0));
    float* o = out + r0 * ldo;
#if defined(__AVX2__)
    if (!portable()) {
      // One weight row at a time: two or four interleaved rows (more fma chains in flight) streamed
      // the weights 1.2-1.9x slower at batch 1 on the AVX2 EPYC (bench: all of a Q8_0 model's matmuls).
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t* wc = w + c * ldw;
        switch (R) {
          case 1: dot_tile_avx2<T, 1, 1>(wc, ldw, xq, r0, o + c, ldo); break;
          case 2: dot_tile_avx2<T, 2, 1>(wc, ldw, xq, r0, o + c, ldo); break;
          case 3: dot_tile_avx2<T, 3, 1>(wc, ldw, xq, r0, o + c, ldo); break;
          default: dot_tile_avx2<T, ROWS, 1>(wc, ldw, xq, r0, o + c, ldo);
        }
      }
      continue;
    }
#endif
    float tmp[ROWS];
    for (int64_t c = 0; c < cols; ++c) {
      dot_rows_portable<T>(w + c * ldw, xq, r0, R, tmp);
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
              "packed must come from specd.engine.quant (a 1-D uint8 tensor)");
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
  const QuantizedRows xq = quantize_rows(xc.data_ptr<bf16>(), M, p.K);
  float* yf = float_out ? y.data_ptr<float>() : nullptr;
  bf16* yb = float_out ? nullptr : y.data_ptr<bf16>();
  // Work items: chunks of 16 output columns; each computes its columns for all rows, segment by
  // segment, in groups of ROWS rows over the same weight rows (in cache). The split changes only the speed.
  constexpr int64_t CHUNK = 16;
  at::parallel_for(0, (N + CHUNK - 1) / CHUNK, 1, [&](int64_t c0, int64_t c1) {
    const int64_t n_begin = c0 * CHUNK, n_end = std::min(N, c1 * CHUNK);
    std::vector<float> out(M * (n_end - n_begin));
    const int64_t ldo = n_end - n_begin;
    int64_t seg_first = 0;
    for (const Segment& s : p.segments) {
      const int64_t lo = std::max(n_begin, seg_first), hi = std::min(n_end, seg_first + s.rows);
      if (lo < hi) {
        const uint8_t* w = p.base + s.offset + (lo - seg_first) * s.row_bytes;
        by_type(s.type, [&](auto t) {
          dot_block<decltype(t)::value>(w, s.row_bytes, hi - lo, xq, M, out.data() + (lo - n_begin), ldo);
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
