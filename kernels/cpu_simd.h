// 16 float32 lanes for the fused CPU ops: one AVX-512 register, or two AVX2 registers where the
// CPU (or its hypervisor) offers AVX2 + FMA only (kernels/cpu_ops.py builds for whichever it has).
// Lane l of every operation is the same float32 arithmetic on both, and reduce_add sums the 16
// lanes in the same tree on both (that of GCC's _mm512_reduce_add_ps), so the two builds give the
// same bits (tests/kernels/test_isa_builds.py).
//
// SPECD_EMULATE_AVX512 (a test build, SPECD_CPU_ISA=avx512-emulated): the AVX-512 code compiled
// for an AVX2 CPU through SIMDe's portable intrinsics, so a machine without AVX-512 still checks it.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(SPECD_EMULATE_AVX512)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#undef _mm512_madd_epi16  // SIMDe 0.7.4's alias of it takes the masked form's 4 arguments
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
#undef _mm512_shuffle_f32x4  // SIMDe 0.7.4 has it but no alias: the name would reach GCC's AVX-512 intrinsic
#define _mm512_shuffle_f32x4(a, b, imm8) simde_mm512_shuffle_f32x4(a, b, imm8)
#define SPECD_AVX512 1
#elif defined(__AVX512F__)
#define SPECD_AVX512 1
#endif

namespace specd_simd {

// Whether environment variable `name` is "0": the switch that turns off an instruction the ops use
// where the CPU has it (SPECD_CPU_BF16_DOT, SPECD_CPU_VNNI), for tests of the other path.
inline bool switched_off(const char* name) {
  const char* env = std::getenv(name);
  return env && std::strcmp(env, "0") == 0;
}

using bf16 = c10::BFloat16;
constexpr int64_t LANES = 16;

#if defined(SPECD_AVX512)
constexpr const char* ISA = "avx512";
struct V16 {
  __m512 v;
};
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 set1(float a) { return {_mm512_set1_ps(a)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
#if defined(SPECD_EMULATE_AVX512)
// What SIMDe 0.7.4 lacks of the native code below, lane by lane; lanes past n are never read.
inline V16 load_first(const float* p, int64_t n) {
  alignas(64) float t[LANES] = {};
  std::memcpy(t, p, n * sizeof(float));
  return load(t);
}
inline void store_first(float* p, V16 a, int64_t n) {
  alignas(64) float t[LANES];
  store(t, a);
  std::memcpy(p, t, n * sizeof(float));
}
inline V16 load_bf16_first(const bf16* p, int64_t n) {
  alignas(64) uint32_t t[LANES] = {};
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(p[i].x) << 16;
  return {_mm512_castsi512_ps(_mm512_loadu_si512(t))};
}
inline V16 load_bf16(const bf16* p) { return load_bf16_first(p, LANES); }
inline float reduce_add(V16 a) {  // GCC's _mm512_reduce_add_ps: halves, quarters, then (0 + 2) + (1 + 3)
  alignas(64) float t[LANES];
  store(t, a);
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = t[i + 8] + t[i];
  for (int i = 0; i < 4; ++i) q[i] = h[i + 4] + h[i];
  return (q[0] + q[2]) + (q[1] + q[3]);
}
#else
inline __mmask16 first(int64_t n) { return (__mmask16)((1u << n) - 1); }
inline V16 load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }
inline void store_first(float* p, V16 a, int64_t n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline V16 widen(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }
inline V16 load_bf16(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline V16 load_bf16_first(const bf16* p, int64_t n) { return widen(_mm256_maskz_loadu_epi16(first(n), p)); }
inline float reduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
#endif
// Lane k = reduce_add(p[k]), for 16 vectors at once: the same pairs added in the same tree (halves,
// quarters, then (0 + 2) + (1 + 3)), with the vectors' lanes transposed as they are summed, so a
// score costs a share of 15 adds instead of a whole horizontal reduction. Fed in the order below,
// the tree leaves vector 4c + m in lane 4c + m.
inline V16 reduce_add16(const V16* p) {
  auto in = [p](int i) { return p[4 * (i % 4) + i / 4].v; };
  __m512 s[8], u[4];
  for (int k = 0; k < 8; ++k)  // lanes 0-7: vector 2k's i + (i + 8); lanes 8-15: vector 2k + 1's
    s[k] = _mm512_add_ps(_mm512_shuffle_f32x4(in(2 * k), in(2 * k + 1), 0x44),
                         _mm512_shuffle_f32x4(in(2 * k), in(2 * k + 1), 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit chunk c: vector 4k + c's quarters i + (i + 4)
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return {_mm512_add_ps(_mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)))};
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* ISA = "avx2";
struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load_first(const float* p, int64_t n) {  // lanes n.. are zero; nothing past p + n is read
  alignas(32) float t[LANES] = {};
  std::memcpy(t, p, n * sizeof(float));
  return load(t);
}
inline void store(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void store_first(float* p, V16 a, int64_t n) {
  alignas(32) float t[LANES];
  store(t, a);
  std::memcpy(p, t, n * sizeof(float));
}
inline __m256 widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V16 load_bf16(const bf16* p) {
  return {widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V16 load_bf16_first(const bf16* p, int64_t n) {
  alignas(32) bf16 t[LANES] = {};
  std::memcpy(t, p, n * sizeof(bf16));
  return load_bf16(t);
}
inline float reduce_add(V16 a) {  // (lo + hi), then halves: a fixed tree
  __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
// Lane k = reduce_add(p[k]) for 16 vectors at once, the same tree with the lanes transposed as they
// are summed (see the AVX-512 one); fed in the order below, 8 vectors land in order in 8 lanes.
inline __m256 reduce_add8(const V16* p) {
  auto in = [p](int i) { return p[4 * (i % 2) + i / 2]; };
  __m256 s[8], u[4];
  for (int k = 0; k < 8; ++k) s[k] = _mm256_add_ps(in(k).lo, in(k).hi);
  for (int k = 0; k < 4; ++k)  // 128-bit half c: vector 2k + c's quarters i + (i + 4)
    u[k] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * k], s[2 * k + 1], 0x20),
                         _mm256_permute2f128_ps(s[2 * k], s[2 * k + 1], 0x31));
  const __m256 w0 = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 w1 = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline V16 reduce_add16(const V16* p) { return {reduce_add8(p), reduce_add8(p + 8)}; }
#else
#error "the fused CPU ops need AVX-512 (f, bw, vl) or AVX2 with FMA"
#endif

}  // namespace specd_simd
