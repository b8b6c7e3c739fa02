// The k-quant matmul (Q4_K, Q6_K: what a Q4_K_M file is made of) on AMX-INT8 tiles, with its own
// arithmetic, for every row count where the CPU has AMX-INT8 (kernels/cpu_quant_matmul.cpp calls it).
//
// Why its own bits: the other paths keep eight int32 lanes per output (lane l the products of k = 4l
// .. 4l+3 of each block of 32, cpu_quant_matmul.cpp's header), which a tile product cannot keep
// apart, and on this CPU kind they are at the bound of their multiply port: a 9-token forward of a
// Qwen2.5-1.5B-shaped Q4_K_M cost 2.1-3.1x a 1-token one (bench/results/verify_rows_q4km_1p5b_xeon_amx.md).
// Here, per output (row m of x, weight row n), blocks of 256 in order:
//  - x quantized as for the other k-quant paths (per 256: int8 values, a float scale dx, per 32 their sum);
//  - Q4_K: per sub-block j of 32, S_j = the exact int32 sum of x_q q (one tile product with K = 32),
//    isum = sum_j sc_j S_j (int32, exact), acc = fma(d dx, isum, acc); the min term as the other paths
//    take it, msum = sum_j m_j xsum_j (int32), macc = fma(-(dmin dx), msum, macc);
//  - Q6_K: per 16 weights S (a tile product with K = 16) of x_q (q - 32), isum = sum sc S, one fma;
//  - the result acc + macc: one float accumulator per output, no lanes.
// Integer sums are exact in any order, and the float steps are the same expression for every row
// count, tile shape and thread count, so a row's bits depend on that row and W only: batch-invariant
// by construction, since every row count (decode too) takes this path. SPECD_CPU_AMX=0 (or
// SPECD_QUANT_PORTABLE=1) keeps the lane paths, as for the bf16 matmul's AMX path (cpu_bf16_matmul.cpp).
//
// The tiles: A = 16 weight rows of one block, unpacked to int8 in a 16 x 256 scratch (rows as the
// weights lie, so no transpose); B = x in the VNNI layout ([k / 4][row][4], made once per call);
// C = 16 weight rows x up to 16 rows of x, one tile product per sub-block into a zeroed C tile,
// stored, then sc applied with AVX-512 on lanes e = n x rows + m (the scales, d and dmin of the 16
// weight rows gathered as vectors over n, and spread over e with a permute). More than 16 rows: groups
// of 16 (the last padded with zero rows). One row (decode) leaves 15 of C's 16 columns idle, so it
// takes 64 k a product instead, B block-diagonal (2 sub-blocks of 32, or 4 of 16, side by side, each
// in its own column): 4 products a block where it would be 8 (Q4_K) or 16 (Q6_K); the integers, and so
// the bits, are the same. The tiles' chain (zero, product, store a C tile, read it back) bounds the
// one-row speed as much as the weights' bytes do, so fewer products made one row 19-24% faster.
//
// Measured on the 2-core Xeon (family 6 model 167), 2 threads, the Qwen2.5-1.5B-shaped Q4_K_M-like
// random file (bench/verify_rows.py, 2026-12-02 13:15 UTC, idle machine): the whole forward over 1
// token 53.9 ms against 71.9 on the lane paths, over 9 tokens 103.4 against 158.2 (1.92x of 1 token
// against 2.20x); the k-quant matmuls alone 1.82x at 9 tokens, the rest of the 9-token time mostly
// the Q8_0 LM head and Q5_0 q / k projections on the lane paths
// (bench/results/verify_rows_q4km_1p5b_xeon_amx_int8.md).
//
// One file (about 410 lines): the tile shapes, the scratch layouts they read and the one float
// expression that makes the path batch-invariant belong together.
#include "cpu_quant_amx.h"

#include <c10/util/Exception.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cstring>

#if defined(SPECD_AVX512) && !defined(SPECD_EMULATE_AVX512)
#include <sys/syscall.h>
#include <unistd.h>
#define SPECD_AMX_INT8 1
#endif

namespace specd_quant_amx {

#if defined(SPECD_AMX_INT8)
namespace {

constexpr int64_t Q4_K = 12, Q6_K = 14;
constexpr int64_t Q4_K_BYTES = 144, Q6_K_BYTES = 210;
constexpr int64_t SCRATCH = 256;  // bytes per weight row of the A scratch: one block

struct alignas(64) TileConfig {  // the 64-byte operand of ldtilecfg (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C tiles 0-5 (16 weight rows x mg int32), A tile 6 (16 weight rows x KS bytes), B tile 7 (KS / 4
// rows x mg groups of 4 bytes); sub-block j takes C j % 6. (Each sub-block's C waits for the store of
// the one before it in that tile: six of them in flight were 2-7% faster at 1 row than four C tiles
// beside two A and two B.)
// (One row: A 64 bytes wide, B 16 x 4 spb, C 16 x spb int32: the block-diagonal form below.)
__attribute__((target("amx-tile"))) void configure(int a_colsb, int b_rows, int c_colsb) {
  TileConfig c;
  for (int t = 0; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = c_colsb;
  c.rows[6] = 16, c.colsb[6] = a_colsb;
  c.rows[7] = b_rows, c.colsb[7] = c_colsb;
  // GCC 12's _tile_loadconfig does not tell the optimiser that it reads the struct (cpu_bf16_matmul.cpp)
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}
__attribute__((target("amx-tile"))) void release() { _tile_release(); }

// One sub-block's tile product: A at a (stride SCRATCH), B at b (stride 4 mg), C stored to c.
#define SPECD_SUB(TC, TA, TB, a, b, mg, c) SPECD_PRODUCT(TC, TA, TB, a, SCRATCH, b, mg, c)
// Sub-block i of a block into C tile TC (column_block's scratch, xb, cbuf, KS and MG).
#define SPECD_SUB_AT(TC, i) SPECD_SUB(TC, 6, 7, scratch + (i) * KS, xb + (i) * KS * MG, MG, cbuf + (i) * 16 * MG)
#define SPECD_PRODUCT(TC, TA, TB, a, lda, b, mg, c) \
  do {                                     \
    _tile_zero(TC);                        \
    _tile_loadd(TA, a, lda);               \
    _tile_loadd(TB, b, 4 * (mg));          \
    _tile_dpbssd(TC, TA, TB);              \
    _tile_stored(TC, c, 4 * (mg));         \
  } while (0)

// The 16 (or fewer: mask) weight rows' 32-bit words at byte `offset` of block ib, as a vector over n.
inline __m512i gather_words(const uint8_t* w, __m512i rows, __mmask16 mask, int64_t offset) {
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, w + offset, 1);
}
inline __m512 halves(__m512i v, int high) {  // the fp16 in the low / high half of each word
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high ? _mm512_srli_epi32(v, 16) : v));
}

// A block's values of one weight row as int8 in k order (the other paths' decoders, Q<T>::values).
inline void unpack_q4k(const uint8_t* b, int8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0xF);
  for (int h = 0; h < 2; ++h) {  // bytes 64h .. 64h+63: sub-blocks 4h .. 4h+3
    const __m512i z = _mm512_loadu_si512(b + 16 + 64 * h);
    const __m512i lo = _mm512_and_si512(z, low4), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
    _mm512_store_si512(out + 128 * h, _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm512_store_si512(out + 128 * h + 64, _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2)));
  }
}
inline void unpack_q6k(const uint8_t* b, int8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0xF), two = _mm512_set1_epi8(0x30), offset = _mm512_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {  // half h: ql bytes 64h .., qh bytes 128 + 32h ..
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    // bytes 0-31: bits 0-1 and 4-5 (sub-blocks t = 0, 2); 32-63: bits 2-3 and 6-7 (t = 1, 3), moved down
    const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    const __m512i lo = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_slli_epi16(qh2, 4), two));
    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_and_si512(qh2, two));
    _mm512_store_si512(out + 128 * h, _mm512_sub_epi8(lo, offset));
    _mm512_store_si512(out + 128 * h + 64, _mm512_sub_epi8(hi, offset));
  }
}

inline void prefetch_block(const uint8_t* b, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(b) + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b) + bytes - 1, _MM_HINT_T0);
}
constexpr int64_t AHEAD = 4;  // blocks ahead each weight row is prefetched

// Lanes e = n mg + m of vector i (e = 16 i + l): n's and m's indices for the permutes.
template <int MG> struct Spread {
  __m512i n[MG], m[MG];
  Spread() {
    for (int i = 0; i < MG; ++i) {
      alignas(64) int32_t a[16], b[16];
      for (int l = 0; l < 16; ++l) a[l] = (16 * i + l) / MG, b[l] = (16 * i + l) % MG;
      n[i] = _mm512_load_si512(a);
      m[i] = _mm512_load_si512(b);
    }
  }
};
template <int MG> inline __m512i by_n(const Spread<MG>& s, int i, __m512i v) {
  return MG == 1 ? v : _mm512_permutexvar_epi32(s.n[i], v);
}
template <int MG> inline __m512i by_m(const Spread<MG>& s, int i, __m512i v) {
  return _mm512_permutexvar_epi32(s.m[i], v);  // (MG = 1: lane 0 to all)
}

// 16 weight rows from w (`cols` of them real) against group g -> out[g.rows][ldo].
template <int64_t T, int MG>
void column_block(const uint8_t* w, int64_t ldw, int64_t cols, const Group& g, int64_t K, const Spread<MG>& sp,
                  int8_t* scratch, int32_t* cbuf, float* out, int64_t ldo) {
  constexpr bool Q4 = T == Q4_K;
  constexpr int64_t BYTES = Q4 ? Q4_K_BYTES : Q6_K_BYTES;
  constexpr int SUBS = Q4 ? 8 : 16, KS = 256 / SUBS, SPB = Q4 ? 2 : 4;
  const int64_t nblk = K / 256;
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(ldw)));
  __m512 acc[MG], macc[MG];
  for (int i = 0; i < MG; ++i) acc[i] = macc[i] = _mm512_setzero_ps();
  // (one row) the permutes of the block-diagonal form: a pair's scales, every 2nd and 4th lane
  const __m512i pair_index = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                even_index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                fourth_index = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t ib = 0; ib < nblk; ++ib) {
    const uint8_t* wb = w + ib * BYTES;
    // AHEAD blocks on, or past a row's end the next column block's first ones (a prefetch past the
    // weight's end is harmless): K = 1536 has only 6 blocks a row
    const uint8_t* ahead = ib + AHEAD < nblk ? wb + AHEAD * BYTES : w + 16 * ldw + (ib + AHEAD - nblk) * BYTES;
    for (int64_t c = 0; c < 16; ++c) prefetch_block(ahead + c * ldw, BYTES);
    for (int64_t c = 0; c < cols; ++c) {
      if constexpr (Q4) unpack_q4k(wb + c * ldw, scratch + c * SCRATCH);
      else unpack_q6k(wb + c * ldw, scratch + c * SCRATCH);
    }
    asm volatile("" : : : "memory");  // the tile loads read the scratch (their asm says nothing of memory)
    const int8_t* xb = g.xb.data() + ib * 256 * MG;
    if constexpr (MG == 1) {
      // One row: each product takes 64 k, SPB sub-blocks side by side (block-diagonal B), so a block is
      // 4 products where it was 8 (Q4_K) or 16 (Q6_K).
      const int8_t* xd = (Q4 ? g.xd2.data() : g.xd4.data()) + ib * 4 * 64 * SPB;
      SPECD_PRODUCT(0, 6, 7, scratch + 0, SCRATCH, xd + 0 * 64 * SPB, SPB, cbuf + 0 * 16 * SPB);
      SPECD_PRODUCT(1, 6, 7, scratch + 64, SCRATCH, xd + 1 * 64 * SPB, SPB, cbuf + 1 * 16 * SPB);
      SPECD_PRODUCT(2, 6, 7, scratch + 128, SCRATCH, xd + 2 * 64 * SPB, SPB, cbuf + 2 * 16 * SPB);
      SPECD_PRODUCT(3, 6, 7, scratch + 192, SCRATCH, xd + 3 * 64 * SPB, SPB, cbuf + 3 * 16 * SPB);
    } else {  // Q4_K: 8 sub-blocks of 32; Q6_K: 16 of 16, C tiles 0-5 in turn (the tile macros
      // stringify their tile numbers into the asm: literal numbers, so no loop)
      SPECD_SUB_AT(0, 0); SPECD_SUB_AT(1, 1); SPECD_SUB_AT(2, 2); SPECD_SUB_AT(3, 3);
      SPECD_SUB_AT(4, 4); SPECD_SUB_AT(5, 5); SPECD_SUB_AT(0, 6); SPECD_SUB_AT(1, 7);
      if constexpr (!Q4) {
        SPECD_SUB_AT(2, 8); SPECD_SUB_AT(3, 9); SPECD_SUB_AT(4, 10); SPECD_SUB_AT(5, 11);
        SPECD_SUB_AT(0, 12); SPECD_SUB_AT(1, 13); SPECD_SUB_AT(2, 14); SPECD_SUB_AT(3, 15);
      }
    }
    asm volatile("" : : : "memory");  // cbuf is read below (the tile stores' asm says nothing of memory)
    // the scales of the 16 weight rows as vectors over n (while the tiles run)
    __m512i sc[SUBS], mpair[4];
    alignas(64) int8_t q6sc[4][64];  // Q6_K's scale words as gathered (the block-diagonal form reads them)
    __m512 d, dmin;
    if constexpr (Q4) {
      const __m512i dm = gather_words(wb, rows, mask, 0), u0 = gather_words(wb, rows, mask, 4),
                    u1 = gather_words(wb, rows, mask, 8), u2 = gather_words(wb, rows, mask, 12);
      const __m512i m6 = _mm512_set1_epi32(0x3f3f3f3f), m4 = _mm512_set1_epi32(0x0f0f0f0f),
                    hi2 = _mm512_set1_epi32(0x30303030), byte = _mm512_set1_epi32(0xFF);
      // k4_scales' words: sc 0-3, sc 4-7, m 0-3, m 4-7, a byte each
      const __m512i w0 = _mm512_and_si512(u0, m6),
                    w1 = _mm512_or_si512(_mm512_and_si512(u2, m4), _mm512_and_si512(_mm512_srli_epi32(u0, 2), hi2)),
                    w2 = _mm512_and_si512(u1, m6),
                    w3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m4),
                                         _mm512_and_si512(_mm512_srli_epi32(u1, 2), hi2));
      for (int j = 0; j < 4; ++j) {
        sc[j] = _mm512_and_si512(_mm512_srli_epi32(w0, 8 * j), byte);
        sc[j + 4] = _mm512_and_si512(_mm512_srli_epi32(w1, 8 * j), byte);
      }
      // (m_2p, m_2p+1) as int16 pairs: bytes 0, 1 and bytes 2, 3 of a word of mins
      const __m512i low_byte = _mm512_set1_epi32(0xFF), second_byte = _mm512_set1_epi32(0xFF00);
      auto pairs = [&](__m512i v, __m512i& a, __m512i& b) {
        a = _mm512_or_si512(_mm512_and_si512(v, low_byte), _mm512_slli_epi32(_mm512_and_si512(v, second_byte), 8));
        b = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v, 16), low_byte), _mm512_slli_epi32(_mm512_srli_epi32(v, 24), 16));
      };
      pairs(w2, mpair[0], mpair[1]);
      pairs(w3, mpair[2], mpair[3]);
      d = halves(dm, 0);
      dmin = halves(dm, 1);
    } else {
      for (int q = 0; q < 4; ++q) {
        const __m512i v = gather_words(wb, rows, mask, 192 + 4 * q);
        if constexpr (MG == 1) _mm512_store_si512(q6sc[q], v);
        for (int b = 0; b < 4; ++b) sc[4 * q + b] = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24);
      }
      d = halves(gather_words(wb, rows, mask, 206), 1);  // (bytes 208-209; 206 so no read passes the block)
      dmin = _mm512_setzero_ps();
    }
    const __m512 dxv = _mm512_loadu_ps(g.dx.data() + ib * 16);
    for (int i = 0; i < MG; ++i) {
      __m512i isum = _mm512_setzero_si512();
      if constexpr (MG == 1) {
        // product t's C: lane l of vector v is weight row (16 v + l) / SPB, sub-block SPB t + l % SPB
        __m512i part[SPB];
        for (int v = 0; v < SPB; ++v) part[v] = _mm512_setzero_si512();
        for (int t = 0; t < 4; ++t)
          for (int v = 0; v < SPB; ++v) {
            __m512i scale;
            if constexpr (Q4)  // sc_2t of row 8v + l / 2 in even lanes, sc_2t+1 in odd
              scale = _mm512_permutex2var_epi32(sc[2 * t], _mm512_add_epi32(_mm512_set1_epi32(8 * v), pair_index), sc[2 * t + 1]);
            else  // bytes 16v .. 16v+15 of the scale words at 192 + 4t: rows 4v .. 4v+3, 4 scales each
              scale = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q6sc[t] + 16 * v)));
            part[v] = _mm512_add_epi32(part[v], _mm512_mullo_epi32(_mm512_loadu_si512(cbuf + t * 16 * SPB + 16 * v), scale));
          }
        // each row's SPB lanes summed (exact: integers), then the rows in order
        if constexpr (Q4) {
          const __m512i a = _mm512_add_epi32(part[0], _mm512_shuffle_epi32(part[0], _MM_PERM_CDAB)),
                        b = _mm512_add_epi32(part[1], _mm512_shuffle_epi32(part[1], _MM_PERM_CDAB));
          isum = _mm512_permutex2var_epi32(a, even_index, b);
        } else {
          __m512i r[4];
          for (int v = 0; v < 4; ++v) {
            r[v] = _mm512_add_epi32(part[v], _mm512_shuffle_epi32(part[v], _MM_PERM_CDAB));
            r[v] = _mm512_add_epi32(r[v], _mm512_shuffle_epi32(r[v], _MM_PERM_BADC));
          }
          isum = _mm512_shuffle_i64x2(_mm512_permutex2var_epi32(r[0], fourth_index, r[1]),
                                      _mm512_permutex2var_epi32(r[2], fourth_index, r[3]), _MM_SHUFFLE(1, 0, 1, 0));
        }
      } else {
        for (int j = 0; j < SUBS; ++j)
          isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_loadu_si512(cbuf + j * 16 * MG + 16 * i), by_n(sp, i, sc[j])));
      }
      const __m512 dx = _mm512_castsi512_ps(by_m(sp, i, _mm512_castps_si512(dxv)));
      const __m512 dd = _mm512_mul_ps(_mm512_castsi512_ps(by_n(sp, i, _mm512_castps_si512(d))), dx);
      acc[i] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(isum), acc[i]);
      if constexpr (Q4) {
        __m512i msum = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p)
          msum = _mm512_add_epi32(msum, _mm512_madd_epi16(by_n(sp, i, mpair[p]),
                                                          by_m(sp, i, _mm512_loadu_si512(g.xsp.data() + (ib * 4 + p) * 16))));
        const __m512 t = _mm512_mul_ps(_mm512_castsi512_ps(by_n(sp, i, _mm512_castps_si512(dmin))), dx);
        macc[i] = _mm512_fnmadd_ps(t, _mm512_cvtepi32_ps(msum), macc[i]);  // fma(-(dmin dx), msum, macc)
      }
    }
  }
  alignas(64) float res[16 * MG];
  for (int i = 0; i < MG; ++i) _mm512_store_ps(res + 16 * i, _mm512_add_ps(acc[i], macc[i]));
  for (int m = 0; m < g.rows; ++m)
    for (int64_t c = 0; c < cols; ++c) out[m * ldo + c] = res[c * MG + m];
}

template <int64_t T, int MG>
void group_rows(const uint8_t* w, int64_t ldw, int64_t cols, const Group& g, int64_t K, float* out, int64_t ldo) {
  static const Spread<MG> sp;
  alignas(64) int8_t scratch[16 * SCRATCH];
  alignas(64) int32_t cbuf[16 * 16 * MG];
  std::memset(scratch, 0, sizeof(scratch));  // rows past `cols` stay zero
  if constexpr (MG == 1) configure(64, 16, 4 * (T == Q4_K ? 2 : 4));
  else configure(T == Q4_K ? 32 : 16, T == Q4_K ? 8 : 4, 4 * MG);
  for (int64_t c0 = 0; c0 < cols; c0 += 16)
    column_block<T, MG>(w + c0 * ldw, ldw, std::min<int64_t>(16, cols - c0), g, K, sp, scratch, cbuf, out + c0, ldo);
  release();
}

template <class F>
void with_mg(int mg, F&& f) {
  using std::integral_constant;
  switch (mg) {
    case 1: return f(integral_constant<int, 1>());
    case 2: return f(integral_constant<int, 2>());
    case 3: return f(integral_constant<int, 3>());
    case 4: return f(integral_constant<int, 4>());
    case 5: return f(integral_constant<int, 5>());
    case 6: return f(integral_constant<int, 6>());
    case 7: return f(integral_constant<int, 7>());
    case 8: return f(integral_constant<int, 8>());
    case 9: return f(integral_constant<int, 9>());
    case 10: return f(integral_constant<int, 10>());
    case 11: return f(integral_constant<int, 11>());
    case 12: return f(integral_constant<int, 12>());
    case 13: return f(integral_constant<int, 13>());
    case 14: return f(integral_constant<int, 14>());
    case 15: return f(integral_constant<int, 15>());
    default: return f(integral_constant<int, 16>());
  }
}

}  // namespace

bool usable() {
  static const bool yes = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
                          !specd_simd::switched_off("SPECD_CPU_AMX") &&
                          syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return yes;
}

Rows prepare(const int8_t* q, const float* d, const int32_t* sums, int64_t M, int64_t K) {
  Rows out;
  const int64_t nblk = K / 256;
  const int mg = M <= 16 ? static_cast<int>(M) : 16;
  for (int64_t r0 = 0; r0 < M; r0 += mg) {
    Group g;
    g.r0 = r0;
    g.rows = static_cast<int>(std::min<int64_t>(mg, M - r0));
    g.mg = mg;
    g.xb.assign(K * mg, 0);
    g.dx.assign(nblk * 16, 0.0f);
    g.xsp.assign(nblk * 4 * 16, 0);
    for (int m = 0; m < g.rows; ++m) {
      const int8_t* x = q + (r0 + m) * K;
      if (mg == 1) {
        std::memcpy(g.xb.data(), x, K);  // one row: the layout is the row
        // and block-diagonal: per 64 k, 16 rows of spb groups of 4, row r's in group r / (16 / spb)
        g.xd2.assign(K * 2, 0);
        g.xd4.assign(K * 4, 0);
        for (int64_t k4 = 0; k4 < K / 4; ++k4) {
          const int64_t chunk = k4 / 16, r = k4 % 16;
          std::memcpy(g.xd2.data() + chunk * 128 + r * 8 + (r / 8) * 4, x + 4 * k4, 4);
          std::memcpy(g.xd4.data() + chunk * 256 + r * 16 + (r / 4) * 4, x + 4 * k4, 4);
        }
      } else {
        for (int64_t k4 = 0; k4 < K / 4; ++k4) std::memcpy(g.xb.data() + (k4 * mg + m) * 4, x + 4 * k4, 4);
      }
      for (int64_t b = 0; b < nblk; ++b) {
        g.dx[b * 16 + m] = d[(r0 + m) * nblk + b];
        const int32_t* s = sums + (r0 + m) * (K / 32) + 8 * b;
        for (int p = 0; p < 4; ++p)
          g.xsp[(b * 4 + p) * 16 + m] = static_cast<int32_t>((static_cast<uint32_t>(s[2 * p]) & 0xFFFFu) |
                                                             (static_cast<uint32_t>(s[2 * p + 1]) << 16));
      }
    }
    out.groups.push_back(std::move(g));
  }
  return out;
}

void k_rows(int64_t type, const uint8_t* w, int64_t ldw, int64_t cols, const Rows& x, int64_t K, float* out,
            int64_t ldo) {
  TORCH_CHECK(type == Q4_K || type == Q6_K, "the AMX path takes Q4_K and Q6_K");
  for (const Group& g : x.groups)
    with_mg(g.mg, [&](auto m) {
      constexpr int MG = decltype(m)::value;
      if (type == Q4_K) group_rows<Q4_K, MG>(w, ldw, cols, g, K, out + g.r0 * ldo, ldo);
      else group_rows<Q6_K, MG>(w, ldw, cols, g, K, out + g.r0 * ldo, ldo);
    });
}

#else  // no AVX-512 build: never taken

bool usable() { return false; }
Rows prepare(const int8_t*, const float*, const int32_t*, int64_t, int64_t) { return {}; }
void k_rows(int64_t, const uint8_t*, int64_t, int64_t, const Rows&, int64_t, float*, int64_t) {
  TORCH_CHECK(false, "the AMX path is not built here");
}

#endif

}  // namespace specd_quant_amx
