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
// the operand layout of AVX512-BF16's vdpbf16ps. CPUs without it, and those where it is slower
// (dot_products_pay), widen the pair to float32 and take two FMAs in the same order: in 16 lanes
// with AVX-512, in two halves of 8 with AVX2 (kernels/cpu_simd.h).
//
// CPUs with AMX (Xeon since Sapphire Rapids) take the same packed weight as tiles: 16 pairs of a
// column block are one 16 x 64-byte B tile, 32 of x's bf16 per row one A tile row, and each
// tdpbf16ps adds 32 products per output. Its sums are not the pair chain above (they round inside
// the instruction in their own order), so its bits are its own, like vdpbf16ps's; but every output
// still sums the same K tiles in the same order whatever the row count (tile rows are computed
// independently), so it is batch-invariant too, and it is the path for every row count of a weight
// whose K is a multiple of 32 (others keep the paths above). Measured on the 2-core Xeon (family 6
// model 167), 2 threads, all of the default target's matmuls (bench/verify_rows.py: the whole
// forward over T tokens, alternating with the vdpbf16ps build, 19:45 UTC): 1 token 5% slower (2% in
// an earlier run; the matmuls alone 2-7% at 1 row run to run, and software prefetch of the B tiles
// made them slower), 4 the same, 9 tokens 1.22x of 1 token against 1.89x
// (bench/results/verify_rows_xeon_amx_tiles.md); every matmul of the default target at 1-128 rows
// 0.75-0.82x of oneDNN's time (bench/results/cpu_matmul_amx.md).
//
// One file (about 580 lines): the AMX, vdpbf16ps and FMA paths read one packed weight layout and
// the path is picked per call (Path, below); apart, the layout and the pick would be defined twice.
#include "cpu_bf16_matmul.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_simd.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(SPECD_AVX512) && !defined(SPECD_EMULATE_AVX512)
#include <sys/syscall.h>
#include <unistd.h>
#define SPECD_AMX 1
#endif

namespace specd_cpu {
namespace {

using bf16 = at::BFloat16;
using namespace specd_simd;
constexpr int64_t PREFETCH = 16;  // pairs ahead

// The two ways to sum a weight pair (k, k+1) into an output, as Ops for the tiles below:
// Op::W is a weight block in the form the Op multiplies, Op::X a row's pair of x, Op::XElem what
// the tiles read x as. Dot takes x as it is; Fma reads x widened to float32 once per call (odd K
// padded with a zero), so a row's pair is two broadcasts from memory, not two shifts per tile row.
#if defined(SPECD_AVX512)
// x's pair (k, k+1) as one 32-bit value, broadcast to 16 lanes; odd K's last pair has k + 1 = 0.
inline __m512i bf16_pair(const bf16* x) {
  int32_t bits;
  std::memcpy(&bits, x, 4);
  return _mm512_set1_epi32(bits);
}

inline __m512i bf16_last_pair(const bf16* x) {
  uint16_t bits;
  std::memcpy(&bits, x, 2);
  return _mm512_set1_epi32(bits);
}

struct Dot {  // acc += x_k w_k + x_k+1 w_k+1 per lane, in one instruction
  using XElem = bf16;
  struct W {
    __m512i v;
  };
  struct X {
    __m512i v;
  };
  static inline W weights(const bf16* w) { return {_mm512_loadu_si512(w)}; }
  static inline X pair(const bf16* x) { return {bf16_pair(x)}; }
  static inline X last_pair(const bf16* x) { return {bf16_last_pair(x)}; }
  // Inline assembly, not the intrinsic: the intrinsic needs the whole caller compiled for
  // AVX512-BF16, which would let the compiler use it elsewhere on CPUs without it.
  static inline V16 step(V16 acc, X x, W w) {
#if !defined(SPECD_EMULATE_AVX512)
    asm("vdpbf16ps %[w], %[x], %[acc]" : [acc] "+v"(acc.v) : [x] "v"(x.v), [w] "v"(w.v));
#endif
    return acc;
  }
};

// A block's pairs as float32: k (the low half of each 32-bit lane) and k + 1 (the high half).
inline void widen_pairs(const bf16* w, V16& even, V16& odd) {
  const __m512i v = _mm512_loadu_si512(w), high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  even.v = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd.v = _mm512_castsi512_ps(_mm512_and_si512(v, high));
}

// Tiles (rows x column blocks) that fit 32 vector registers. 3-6 rows: one tile 4 blocks wide
// (12-24 accumulators in flight; a 6-token forward 0.92x the time it took on a 6 x 2 tile). 7-12
// rows (a verify block): one tile 2 blocks wide, so each weight pair is loaded, and widened for
// Fma, once for all rows: the default target's forward over 9 tokens took 1.50x the time of 1
// token where 6 x 4 tiles (a 6-row pass from memory, then 3 rows again from cache) on vdpbf16ps
// took 1.76x (2-core Xeon family 6 model 207, no AMX; bench/results/verify_rows_xeon_noamx_fma.md).
// More rows: groups of up to 12.
constexpr int DECODE_R = 2, DECODE_C = 8, FEW_R = 6, FEW_C = 4, BLOCK_R = 12, BLOCK_C = 2;
#else  // AVX2 + FMA: the same pairs, as two 8-lane halves, and no bf16 dot product
struct Dot {  // never taken: dot_products_pay() is false
  using XElem = bf16;
  struct W {};
  struct X {};
  static inline W weights(const bf16*) { return {}; }
  static inline X pair(const bf16*) { return {}; }
  static inline X last_pair(const bf16*) { return {}; }
  static inline V16 step(V16 acc, X, W) { return acc; }
};

inline void widen_pairs(const bf16* w, V16& even, V16& odd) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));       // columns 0-7
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));  // columns 8-15
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(lo, high)), _mm256_castsi256_ps(_mm256_and_si256(hi, high))};
}

// Tiles that fit 16 vector registers (each block's accumulator takes two).
constexpr int DECODE_R = 2, DECODE_C = 2, FEW_R = 0, FEW_C = 1, BLOCK_R = 4, BLOCK_C = 1;  // (no FEW tiles)
#endif

struct Fma {  // the same pair as two float32 FMAs, k then k + 1
  using XElem = float;
  struct W {
    V16 even, odd;
  };
  struct X {
    V16 even, odd;
  };
  static inline W weights(const bf16* w) {
    W out;
    widen_pairs(w, out.even, out.odd);
    return out;
  }
  static inline X pair(const float* x) { return {set1(x[0]), set1(x[1])}; }
  static inline X last_pair(const float* x) { return pair(x); }  // x[1] is the padding zero
  static inline V16 step(V16 acc, X x, W w) { return fmadd(x.odd, w.odd, fmadd(x.even, w.even, acc)); }
};

// 16 outputs (the first `valid`) as float32, or rounded to nearest even as torch's float -> bfloat16.
inline void store_out(V16 v, int64_t valid, bf16* y, float* yf) {
  if (yf) {
    store_first(yf, v, valid);
    return;
  }
  alignas(64) float tmp[LANES];
  store(tmp, v);
  for (int64_t l = 0; l < valid; ++l) y[l] = bf16(tmp[l]);
}

// R rows x C column blocks of the output: R * C accumulators in registers, each over all of K.
template <class Op, int R, int C>
void tile(
    const typename Op::XElem* x, int64_t ldx, const bf16* w, int64_t pairs, int64_t K, const float* bias, int64_t n0, int64_t N,
    bf16* y, int64_t ldy, float* yf) {
  V16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  const int64_t block = pairs * 2 * LANES;  // one column block's elements
  auto step = [&](int64_t p, bool last) __attribute__((always_inline)) {
    typename Op::W wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = Op::weights(w + c * block + p * 2 * LANES);
      _mm_prefetch(reinterpret_cast<const char*>(w + c * block + (p + PREFETCH) * 2 * LANES), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const auto* xr = x + r * ldx + 2 * p;
      const typename Op::X xv = last ? Op::last_pair(xr) : Op::pair(xr);
      for (int c = 0; c < C; ++c) acc[r][c] = Op::step(acc[r][c], xv, wv[c]);
    }
  };
  for (int64_t p = 0; p < K / 2; ++p) step(p, false);
  if (K % 2) step(K / 2, true);
  // Fully unrolled (no early exit), so the accumulators stay in registers through the loop above.
  for (int c = 0; c < C; ++c) {
    const int64_t n = n0 + c * LANES;
    const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(LANES, N - n));
    const V16 b = bias ? load_first(bias + n, valid) : zero();
    for (int r = 0; r < R; ++r) store_out(add(acc[r][c], b), valid, y ? y + r * ldy + n : nullptr,
                                          yf ? yf + r * ldy + n : nullptr);
  }
}

// Rows in groups of R (the last group smaller), each group over the same column tile.
template <class Op, int R, int C>
void rows_tile(int64_t rows, const typename Op::XElem* x, int64_t ldx, const bf16* w, int64_t pairs, int64_t K, const float* bias,
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

// `blocks` column blocks from n0: as tiles of C blocks, then C/2, ... 1, so no load reaches past
// the weight's last block.
template <class Op, int R, int C>
void column_tiles(int64_t blocks, int64_t rows, const typename Op::XElem* x, int64_t ldx, const bf16* w, int64_t pairs, int64_t K,
                  const float* bias, int64_t n0, int64_t N, bf16* y, float* yf) {
  int64_t done = 0;
  for (; blocks - done >= C; done += C)
    rows_tile<Op, R, C>(rows, x, ldx, w + done * pairs * 2 * LANES, pairs, K, bias, n0 + done * LANES, N, y, N, yf);
  if constexpr (C > 1) {
    if (done < blocks)
      column_tiles<Op, R, C / 2>(blocks - done, rows, x, ldx, w + done * pairs * 2 * LANES, pairs, K, bias,
                                 n0 + done * LANES, N, y, yf);
  }
}

// AVX2: the rows past the last full group of BLOCK_R, one tile shape (rows, column blocks) per
// count, over the same column tile as the full groups, while it is in cache. An accumulator is one
// chain of two dependent FMAs per K pair, so a tile keeps the FMA units busy only with enough of
// them (8, for 4 cycles of latency on 2 units); a row left after a 4 x 1 tile had 2 and took as
// long as the four before it. A work unit is 2 column blocks wide and that row takes a 1 x 2 tile
// (a 5-token verify forward 0.89x the time: bench/results/verify_rows_avx2.md); 2 x 2 and 3 x 2
// tiles do not fit 16 registers (GCC spills accumulators, measured slower), so 2 and 3 rows keep
// their 2 x 1 and 3 x 1. (AVX-512 splits a unit's rows into even groups instead: matmul.)
struct RestTile {
  int rows, cols;
};
#if defined(SPECD_AVX512)
constexpr int UNIT_C = BLOCK_C;
#else
constexpr int UNIT_C = 2;
constexpr RestTile REST[BLOCK_R] = {{}, {1, 2}, {2, 1}, {3, 1}};

template <class Op>
void rest_tiles(RestTile shape, int64_t blocks, const typename Op::XElem* x, int64_t ldx, const bf16* w, int64_t pairs,
                int64_t K, const float* bias, int64_t n0, int64_t N, bf16* y, float* yf) {
  switch (shape.rows * 8 + shape.cols) {  // REST's shapes
    case 1 * 8 + 2: return column_tiles<Op, 1, 2>(blocks, 1, x, ldx, w, pairs, K, bias, n0, N, y, yf);
    case 2 * 8 + 1: return column_tiles<Op, 2, 1>(blocks, 2, x, ldx, w, pairs, K, bias, n0, N, y, yf);
    case 3 * 8 + 1: return column_tiles<Op, 3, 1>(blocks, 3, x, ldx, w, pairs, K, bias, n0, N, y, yf);
    default: TORCH_CHECK(false, "no rest tile of ", shape.rows, " x ", shape.cols);
  }
}
#endif

template <class Op>
void matmul(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, bf16* y, float* yf) {
  const int64_t pairs = (K + 1) / 2, blocks = (N + LANES - 1) / LANES, block_elems = pairs * 2 * LANES;
  // Tile shapes change only the speed: each output's accumulation order is fixed above.
  // One or two rows (decode): wide tiles keep enough FMAs in flight to stream W. More (verify
  // blocks, prefill): taller tiles that reuse each W load across rows, and the rest over the same
  // columns while they are in cache. Work units are (column tile, chunk of 48 rows),
  // tile-major, so a thread's next unit reads the same W tile from cache, not memory.
  const bool decode = M <= 2, few = !decode && M <= FEW_R;
  const int64_t C = decode ? DECODE_C : few ? FEW_C : UNIT_C, tiles = (blocks + C - 1) / C, chunk = 48;
  const typename Op::XElem* xs;
  int64_t ldx = K;
  std::vector<float> widened;  // Fma's x: float32 rows of 2 * pairs, odd K's last one zero
  if constexpr (std::is_same_v<typename Op::XElem, float>) {
    ldx = 2 * pairs;
    widened.assign(M * ldx, 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) widened[m * ldx + k] = static_cast<float>(x[m * K + k]);
    xs = widened.data();
  } else {
    xs = x;
  }
  const int64_t chunks = (M + chunk - 1) / chunk;
  at::parallel_for(0, tiles * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / chunks, r0 = (i % chunks) * chunk, rows = std::min(chunk, M - r0);
      const int64_t cols = std::min(C, blocks - t * C), n0 = t * C * LANES;
      const bf16* wt = w + t * C * block_elems;
      bf16* yt = y ? y + r0 * N : nullptr;
      float* yft = yf ? yf + r0 * N : nullptr;
      if (decode) {
        column_tiles<Op, DECODE_R, DECODE_C>(cols, rows, xs + r0 * ldx, ldx, wt, pairs, K, bias, n0, N, yt, yft);
        continue;
      }
#if defined(SPECD_AVX512)
      if (few) {
        column_tiles<Op, FEW_R, FEW_C>(cols, rows, xs + r0 * ldx, ldx, wt, pairs, K, bias, n0, N, yt, yft);
        continue;
      }
      // Groups as even as the count allows (13 rows: 6 + 7, not 12 + 1), each one tile of its
      // height (rows_tile): every tile holds enough accumulators to keep the FMA units busy.
      const int64_t groups = (rows + BLOCK_R - 1) / BLOCK_R;
      for (int64_t g = 0, done = 0; g < groups; ++g) {
        const int64_t height = (rows - done) / (groups - g);
        column_tiles<Op, BLOCK_R, BLOCK_C>(cols, height, xs + (r0 + done) * ldx, ldx, wt, pairs, K, bias, n0, N,
                                           yt ? yt + done * N : nullptr, yft ? yft + done * N : nullptr);
        done += height;
      }
#else
      const int64_t full = rows - rows % BLOCK_R;
      column_tiles<Op, BLOCK_R, BLOCK_C>(cols, full, xs + r0 * ldx, ldx, wt, pairs, K, bias, n0, N, yt, yft);
      if (rows > full)
        rest_tiles<Op>(REST[rows - full], cols, xs + (r0 + full) * ldx, ldx, wt, pairs, K, bias, n0, N,
                       yt ? yt + full * N : nullptr, yft ? yft + full * N : nullptr);
#endif
    }
  });
}

constexpr int64_t AMX_K = 32;  // x's bf16 per A tile row: 16 pairs, one B tile of a column block

#if defined(SPECD_AMX)
// SPECD_CPU_AMX=0 (or SPECD_CPU_BF16_DOT=0, which turns off every bf16 dot product) keeps the
// paths above on an AMX CPU. Linux hands a process the tile registers only when asked
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); where it refuses, the paths above run.
bool has_amx() {
  static const bool yes = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                          !switched_off("SPECD_CPU_AMX") && !switched_off("SPECD_CPU_BF16_DOT") &&
                          syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return yes;
}

struct alignas(64) TileConfig {  // the 64-byte operand of ldtilecfg (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two unit shapes. Up to 16 rows (decode, verify blocks): 1 row group x 4 column blocks, C tiles
// 0-3, A tile 4, B tiles 5-7 (the fourth block's B reloads tile 5): four weight streams in flight.
// More rows: up to 32 rows x 2 column blocks, C tiles 0-1 (rows 0-15) and 2-3 (rows 16-31), A tiles
// 4-5, B tiles 6-7. Either way an output sums its K tiles in K order: the bits do not depend on it.
// The configuration is per thread and other code on the thread (oneDNN's AMX kernels) loads and
// releases its own, so each call configures its threads' tiles and releases them when done.
__attribute__((target("amx-tile"))) void configure_tiles(int low, int high) {
  TileConfig c;
  auto set = [&](int t, int rows) { c.rows[t] = rows, c.colsb[t] = 64; };
  for (int t : {0, 1, 4}) set(t, low);
  for (int t : {2, 3}) set(t, high ? high : low);
  set(5, high ? high : 16), set(6, 16), set(7, 16);  // (16: wide units' B tile; tall units' A, unused)
  // GCC 12's _tile_loadconfig does not tell the optimiser that it reads the struct's 64 bytes, and
  // the stores above were dropped without this.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// One C tile (`rows` rows of 16 columns from n) out: bias added, as float32 or rounded to bf16.
void store_c(const float* c, int rows, const float* bias, int64_t n, int64_t N, bf16* y, float* yf) {
  const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(LANES, N - n));
  if (valid == 0) return;
  const V16 b = bias ? load_first(bias + n, valid) : zero();
  for (int r = 0; r < rows; ++r)
    store_out(add(load(c + r * LANES), b), valid, y ? y + r * N + n : nullptr, yf ? yf + r * N + n : nullptr);
}

// B tile j of the column block at w: its 16 pairs of 16 columns, 64 bytes a row.
inline const bf16* b_tile(const bf16* w, int64_t j) { return w + j * AMX_K * LANES; }

__attribute__((target("amx-tile"))) inline void zero_c_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

__attribute__((target("amx-tile,amx-bf16"))) void wide_unit(const bf16* x, int64_t K, const bf16* const w[4]) {
  zero_c_tiles();
  for (int64_t j = 0; j < K / AMX_K; ++j) {
    _tile_loadd(4, x + j * AMX_K, K * 2);
    _tile_loadd(5, b_tile(w[0], j), 64);
    _tile_loadd(6, b_tile(w[1], j), 64);
    _tile_loadd(7, b_tile(w[2], j), 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b_tile(w[3], j), 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// `high`: whether the unit has a second row group (a last chunk of up to 16 rows has not).
__attribute__((target("amx-tile,amx-bf16"))) void tall_unit(const bf16* x, int64_t K, const bf16* const w[2],
                                                             bool high) {
  zero_c_tiles();
  for (int64_t j = 0; j < K / AMX_K; ++j) {
    _tile_loadd(4, x + j * AMX_K, K * 2);
    _tile_loadd(6, b_tile(w[0], j), 64);
    _tile_loadd(7, b_tile(w[1], j), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (high) {
      _tile_loadd(5, x + 16 * K + j * AMX_K, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

__attribute__((target("amx-tile"))) void store_tile(int t, float* c) {
  switch (t) {  // the tile register is part of the instruction
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}

// Work units (column blocks of a unit, chunk of rows), column-major as in matmul() above, so a
// thread's next unit reads the same weight tiles from cache. Past the weight's last block a unit
// reads block 0 again and stores nothing of it.
void matmul_amx(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias, bf16* y, float* yf) {
  const bool wide = M <= 16;
  const int64_t blocks = (N + LANES - 1) / LANES, block_elems = K * LANES, unit_blocks = wide ? 4 : 2;
  const int64_t units_n = (blocks + unit_blocks - 1) / unit_blocks, chunk = 32, chunks = wide ? 1 : (M + chunk - 1) / chunk;
  at::parallel_for(0, units_n * chunks, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float c[16 * LANES];
    int low_now = -1, high_now = -1;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b0 = (i / chunks) * unit_blocks, r0 = (i % chunks) * chunk;
      const int rows = static_cast<int>(std::min(chunk, M - r0)), low = std::min(rows, 16), high = rows - low;
      const bf16* ws[4];
      for (int b = 0; b < unit_blocks; ++b) ws[b] = w + (b0 + b < blocks ? b0 + b : 0) * block_elems;
      if (low != low_now || high != high_now) configure_tiles(low_now = low, high_now = high);
      if (wide) {
        wide_unit(x + r0 * K, K, ws);
      } else {
        tall_unit(x + r0 * K, K, ws, high > 0);
      }
      for (int t = 0; t < 4; ++t) {
        const int64_t block = b0 + (wide ? t : t % 2), r = r0 + (wide ? 0 : (t / 2) * 16);
        const int tile_rows = wide || t < 2 ? low : high;
        if (block >= blocks || tile_rows == 0) continue;
        store_tile(t, c);
        store_c(c, tile_rows, bias, block * LANES, N, y ? y + r * N : nullptr, yf ? yf + r * N : nullptr);
      }
    }
    if (low_now >= 0) release_tiles();
  });
}
#else
bool has_amx() { return false; }
void matmul_amx(const bf16*, int64_t, int64_t, const bf16*, int64_t, const float*, bf16*, float*) {}
#endif

#if defined(SPECD_AVX512) && !defined(SPECD_EMULATE_AVX512)
// SPECD_CPU_BF16_DOT=0 takes the FMA path on CPUs with AVX512-BF16 too, =1 its dot product
// without the measurement below (tests cover both paths).
bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16") && !switched_off("SPECD_CPU_BF16_DOT");
  return yes;
}
#else
bool has_avx512_bf16() { return false; }  // the bf16 dot product is the CPU's instruction, not emulated
#endif

// Seconds for `calls` verify-block tiles (BLOCK_R rows x BLOCK_C column blocks) of Op over a weight
// of K inputs that stays in cache: the arithmetic alone.
template <class Op>
double tile_seconds(const bf16* w, const typename Op::XElem* x, int64_t K, float* y, int calls) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i)
    tile<Op, BLOCK_R, BLOCK_C>(x, K, w, K / 2, K, nullptr, 0, BLOCK_C * LANES, nullptr, BLOCK_C * LANES, y);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// (vdpbf16ps, FMA) seconds of the measurement dot_products_pay() decided on; empty where none ran.
std::vector<double>& dot_probe() {
  static std::vector<double> seconds;
  return seconds;
}

// Whether AVX512-BF16's vdpbf16ps computes a pair faster than two float32 FMAs on this CPU,
// measured once per process (a few ms), the best of 7 interleaved rounds each. Its speed differs by
// CPU: on the 2-core Xeon (family 6 model 207, KVM, no AMX) it retires one every 2 cycles against
// 2 FMAs a cycle, and a tile of the FMA path takes 0.6-0.7x its time (the default target's matmuls
// at 9 rows 0.80-0.86x, at 1 row the same: weights stream from memory). On the AMD EPYC (Zen 4)
// its 9-row matmuls took only 1.21x of 1 row (bench/results/cpu_matmul.md; not timed against FMAs
// there). FMAs only when clearly faster (10%), so a CPU where they tie keeps the dot product.
bool dot_products_pay() {
  static const bool yes = [] {
    if (!has_avx512_bf16()) return false;
    const char* forced = std::getenv("SPECD_CPU_BF16_DOT");
    if (forced && std::strcmp(forced, "1") == 0) return true;
    constexpr int64_t K = 512;
    std::vector<bf16> w(BLOCK_C * LANES * K, bf16(0.01f)), xb(BLOCK_R * K, bf16(0.5f));
    std::vector<float> xf(BLOCK_R * K, 0.5f), y(BLOCK_R * BLOCK_C * LANES);
    double dot = 1e30, fma = 1e30;
    for (int round = 0; round < 7; ++round) {
      dot = std::min(dot, tile_seconds<Dot>(w.data(), xb.data(), K, y.data(), 50));
      fma = std::min(fma, tile_seconds<Fma>(w.data(), xf.data(), K, y.data(), 50));
    }
    dot_probe() = {dot, fma};
    return !(fma < 0.9 * dot);
  }();
  return yes;
}

// The path a weight with K inputs takes on this CPU: its bits are that path's (the header).
enum class Path { Amx, Bf16Dot, Fma };

Path path_for(int64_t K) {
  if (has_amx() && K % AMX_K == 0) return Path::Amx;
  return dot_products_pay() ? Path::Bf16Dot : Path::Fma;
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
  const Path path = path_for(K);
  if (path == Path::Amx) {
    matmul_amx(xc.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), N, bp, yp, yfp);
  } else if (path == Path::Bf16Dot) {
    matmul<Dot>(xc.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), N, bp, yp, yfp);
  } else {
    matmul<Fma>(xc.data_ptr<bf16>(), M, K, packed.data_ptr<bf16>(), N, bp, yp, yfp);
  }
  return y;
}

std::string bf16_matmul_path(int64_t in_features) {
  switch (path_for(in_features)) {
    case Path::Amx: return "amx";
    case Path::Bf16Dot: return "avx512_bf16";
    default: return "fma";
  }
}

std::vector<double> bf16_dot_probe() {
  dot_products_pay();
  return dot_probe();
}

}  // namespace specd_cpu

TORCH_LIBRARY_FRAGMENT(specd_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features, bool float_out=False) -> Tensor");
  m.def("bf16_matmul_path(int in_features) -> str", &specd_cpu::bf16_matmul_path);
  m.def("bf16_dot_probe() -> float[]", &specd_cpu::bf16_dot_probe);
}

TORCH_LIBRARY_IMPL(specd_cpu, CPU, m) {
  m.impl("pack_linear_weight", &specd_cpu::pack_linear_weight);
  m.impl("linear", &specd_cpu::linear);
}
