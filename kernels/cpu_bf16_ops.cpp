// Fused bfloat16 CPU ops for the decoder layer's small steps (kernels/cpu_ops.py builds and loads them).
//
// Why: at batch-1 decode on a 2-core CPU, SmolLM2-135M's matmuls take ~16 ms a token and the
// ~40 small torch ops per layer around them (norm, rotary, KV write, attention, SiLU) another
// ~10 ms, mostly per-op dispatch. Each op here replaces several of them.
//
// Every op is row-local with one fixed reduction order per output element, whatever the number of
// rows: a token's result is the same alone, in a verify block or in a batch (batch-invariant mode).
// Reductions use 16 partial sums (lane l takes elements l, l + 16, ...) folded in a fixed order:
// the compiler can vectorise that without reassociating anything.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_bf16_matmul.h"
#include "cpu_simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <tuple>

namespace {

using namespace specd_simd;
constexpr int L = LANES;

inline float f32(bf16 v) { return static_cast<float>(v); }
inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

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

// sum_i a[i] * b[i]: 16 partial sums (lane l takes i = l, l + 16, ...), then a fixed reduction tree.
inline float dot(const bf16* a, const float* b, int64_t n) {
  V16 part = zero();
  int64_t i = 0;
  for (; i + L <= n; i += L) part = fmadd(load_bf16(a + i), load(b + i), part);
  if (i < n) part = fmadd(load_bf16_first(a + i, n - i), load_first(b + i, n - i), part);
  return reduce_add(part);
}

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

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), name, " must be a CPU bfloat16 tensor");
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

// Query rows of one tile: a block of a KV head's rows that read the same keys (that head's query heads
// for one token, or for several tokens of one sequence), so each key is loaded and widened once for
// all of them. At most 12: their QK partial sums live in a 12 KB buffer, and a verify block of 9 tokens
// (27 rows per KV head of the default target) still splits into enough tiles for both cores.
constexpr int64_t TILE_ROWS = 12;

// exp(scores[j] - mx) for each row of a tile, and each row's sum added in key order, the rows' sums
// interleaved (one add's latency per key would otherwise bound the loop).
inline void exp_and_sums(float* scores, int64_t stride, const int64_t* n, int64_t R, float* total) {
  int64_t n_min = n[0];
  for (int64_t r = 0; r < R; ++r) {
    float* s = scores + r * stride;
    float mx = -INFINITY;
    int64_t j = 0;
    if (n[r] >= L) {  // which of +0 and -0 is the max does not matter below: exp(s - (+0)) == exp(s - (-0))
      V16 m = load(s);
      for (j = L; j + L <= n[r]; j += L) m = max(m, load(s + j));
      float lanes[L];
      store(lanes, m);
      for (int l = 0; l < L; ++l) mx = std::max(mx, lanes[l]);
    }
    for (; j < n[r]; ++j) mx = std::max(mx, s[j]);
    for (int64_t j = 0; j < n[r]; ++j) s[j] = vexp(s[j] - mx);
    total[r] = 0.0f;
    n_min = std::min(n_min, n[r]);
  }
  for (int64_t j = 0; j < n_min; ++j)
    for (int64_t r = 0; r < R; ++r) total[r] += scores[r * stride + j];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = n_min; j < n[r]; ++j) total[r] += scores[r * stride + j];
}

// out rows += p[r][j] * V[j] over keys j in order, for RR rows at once (head dim 16 * C), accumulators
// in registers: RR * C of them.
template <int C, int RR>
inline void weigh_values(const float* p, int64_t stride, const int64_t* n, const bf16* vh, const int64_t* keys,
                         float* out) {
  constexpr int64_t D = 16 * C;
  V16 acc[RR][C];
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  int64_t n_min = n[0];
  for (int r = 1; r < RR; ++r) n_min = std::min(n_min, n[r]);
  for (int64_t j = 0; j < n_min; ++j) {
    const bf16* v = vh + keys[j] * D;
    V16 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_bf16(v + 16 * c);
    for (int r = 0; r < RR; ++r) {
      const V16 w = set1(p[r * stride + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int64_t j = n_min; j < n[r]; ++j) {
      const V16 w = set1(p[r * stride + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(w, load_bf16(vh + keys[j] * D + 16 * c), acc[r][c]);
    }
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) store(out + r * D + 16 * c, acc[r][c]);
}

// Attention of R <= TILE_ROWS query rows (float32, R x 16C) of one KV head over its keys at cache rows
// keys[0..n[r]) (row r reads the first n[r]), into out (float32, R x 16C). Per row, the arithmetic of a
// row alone: each score a 16-lane FMA chain over the head dim, summed in reduce_add's tree, times the
// scale; softmax in key order; the weighted sum of V in key order.
template <int C>
void attend_tile(const float* qf, int64_t R, const int64_t* n, const bf16* kh, const bf16* vh, const int64_t* keys,
                 float scale, std::vector<float>& scores, float* out) {
  constexpr int64_t D = 16 * C;
  int64_t n_max = 0;
  for (int64_t r = 0; r < R; ++r) n_max = std::max(n_max, n[r]);
  const int64_t stride = (n_max + 15) / 16 * 16;
  scores.resize(R * stride);
  float* sp = scores.data();
  V16 part[TILE_ROWS][16];
  const V16 vscale = set1(scale);
  for (int64_t j0 = 0; j0 < n_max; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n_max - j0);
    for (int64_t jj = 0; jj < 16; ++jj) {
      if (jj >= m) {
        for (int64_t r = 0; r < R; ++r) part[r][jj] = zero();
        continue;
      }
      const bf16* k = kh + keys[j0 + jj] * D;
      V16 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load_bf16(k + 16 * c);
      for (int64_t r = 0; r < R; ++r) {
        V16 acc = zero();
        for (int c = 0; c < C; ++c) acc = fmadd(kv[c], load(qf + r * D + 16 * c), acc);
        part[r][jj] = acc;
      }
    }
    for (int64_t r = 0; r < R; ++r)
      if (j0 < n[r]) store(sp + r * stride + j0, mul(reduce_add16(part[r]), vscale));
  }
  float total[TILE_ROWS];
  exp_and_sums(sp, stride, n, R, total);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n[r]; ++j) sp[r * stride + j] /= total[r];
  constexpr int RR = 24 / C;  // accumulator rows that fit in registers beside the values
  int64_t r = 0;
  for (; r + RR <= R; r += RR) weigh_values<C, RR>(sp + r * stride, stride, n + r, vh, keys, out + r * D);
  switch (R - r) {  // the rest in one pass too
    case 0: break;
#define SPECD_REST(k) \
    case k: if constexpr (k < RR) weigh_values<C, k>(sp + r * stride, stride, n + r, vh, keys, out + r * D); break;
    SPECD_REST(1) SPECD_REST(2) SPECD_REST(3) SPECD_REST(4) SPECD_REST(5)
#undef SPECD_REST
  }
}

// One query row over n keys at cache rows `rows`, any head dim: the same arithmetic as attend_tile.
void attend_row(const float* qf, int64_t D, const bf16* kh, const bf16* vh, const int64_t* rows, int64_t n,
                float scale, std::vector<float>& scores, float* acc) {
  scores.resize(n);
  for (int64_t j = 0; j < n; ++j) scores[j] = dot(kh + rows[j] * D, qf, D) * scale;
  float total;
  exp_and_sums(scores.data(), n, &n, 1, &total);
  std::fill(acc, acc + D, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const bf16* v = vh + rows[j] * D;
    const V16 p = set1(scores[j] / total);
    for (int64_t d = 0; d < D; d += L) {
      const int64_t m = std::min<int64_t>(L, D - d);
      store_first(acc + d, fmadd(p, load_bf16_first(v + d, m), load_first(acc + d, m)), m);
    }
  }
}

// Attention of each new token over its keys in the paged cache, read in place through the block table.
// Token t (of batch row seq[t]) attends the keys at key positions kpos(c) for c in [lo, pos[t]],
// lo = max(0, pos[t] - window + 1); kpos(c) = c, or key_index[t, c] for token-tree rows (their context
// then their ancestors, the layout a plain decode of the token sees). Scores, softmax and the
// weighted sum of V run in float32 in that key order: the same bits for a token alone or in any step.
// Work is split in tiles of rows that share keys: the query heads of a KV head, over the consecutive
// tokens of a sequence where every token reads keys 0..pos (no window, no tree).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq, const at::Tensor& pos,
                           const c10::optional<at::Tensor>& key_index, double scale, int64_t window) {
  check_bf16(q, "q");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), hkv = k_cache.size(2), group = H / hkv;
  TORCH_CHECK(H % hkv == 0 && k_cache.size(3) == D, "q does not match the cache's heads");
  auto qc = q.contiguous();
  auto bt = block_tables.to(at::kLong).contiguous();
  auto sq = seq.to(at::kLong).contiguous();
  auto ps = pos.to(at::kLong).contiguous();
  at::Tensor ki;
  const int64_t* kip = nullptr;
  int64_t ki_width = 0;
  if (key_index.has_value() && key_index->defined()) {
    ki = key_index->to(at::kLong).contiguous();
    kip = ki.data_ptr<int64_t>();
    ki_width = ki.size(1);
  }
  const int64_t width = bt.size(1), blocks = k_cache.size(0);
  const int64_t *btp = bt.data_ptr<int64_t>(), *sqp = sq.data_ptr<int64_t>(), *psp = ps.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(psp[t] >= 0 && (kip ? psp[t] < ki_width : psp[t] < width * bs), "key position out of range");
    TORCH_CHECK(sqp[t] >= 0 && sqp[t] < bt.size(0), "batch row out of range");
  }
  // Runs of tokens that read one key list: [run_start[u], run_start[u + 1]); their keys' cache rows
  // (slot * Hkv) from key_start[u], token t reading the first n[t].
  std::vector<int64_t> run_start{0}, key_start{0}, keys, n(T), lo(T);
  for (int64_t t = 0; t < T; ++t) {
    lo[t] = window > 0 ? std::max<int64_t>(0, psp[t] - window + 1) : 0;
    n[t] = psp[t] - lo[t] + 1;
  }
  for (int64_t t = 0; t < T;) {
    int64_t end = t + 1, hi = psp[t];
    if (!kip && window <= 0)
      for (; end < T && sqp[end] == sqp[t]; ++end) hi = std::max(hi, psp[end]);
    for (int64_t c = lo[t]; c <= hi; ++c) {
      const int64_t key = kip ? kip[t * ki_width + c] : c;
      const int64_t block = key >= 0 && key < width * bs ? btp[sqp[t] * width + key / bs] : -1;
      TORCH_CHECK(block >= 0 && block < blocks, "key outside the cache");
      keys.push_back((block * bs + key % bs) * hkv);
    }
    run_start.push_back(end);
    key_start.push_back(static_cast<int64_t>(keys.size()));
    t = end;
  }
  // Tiles: (run, KV head, first row, rows), a run's rows of a KV head ordered token by token. Smaller
  // tiles where there would be too few for the threads (a decode step of one sequence: 3 x 3 rows).
  const int64_t runs = static_cast<int64_t>(run_start.size()) - 1, threads = at::get_num_threads();
  int64_t tile = std::min<int64_t>(TILE_ROWS, group * (run_start[1] - run_start[0]));
  auto count = [&](int64_t size) {
    int64_t c = 0;
    for (int64_t u = 0; u < runs; ++u) c += hkv * ((group * (run_start[u + 1] - run_start[u]) + size - 1) / size);
    return c;
  };
  for (int64_t u = 1; u < runs; ++u) tile = std::max(tile, std::min<int64_t>(TILE_ROWS, group * (run_start[u + 1] - run_start[u])));
  while (tile > 1 && count(tile) < 2 * threads) --tile;
  std::vector<std::array<int64_t, 4>> tiles;
  for (int64_t u = 0; u < runs; ++u) {
    const int64_t rows = group * (run_start[u + 1] - run_start[u]), parts = (rows + tile - 1) / tile;
    for (int64_t g = 0; g < hkv; ++g)
      for (int64_t p = 0; p < parts; ++p)  // sizes differ by at most one
        tiles.push_back({u, g, p * rows / parts, (p + 1) * rows / parts - p * rows / parts});
  }
  auto out = at::empty_like(qc);
  const bf16 *qp = qc.data_ptr<bf16>(), *kp = k_cache.data_ptr<bf16>(), *vp = v_cache.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(TILE_ROWS * D), acc(TILE_ROWS * D), scores;
    int64_t row_index[TILE_ROWS], nr[TILE_ROWS];
    for (int64_t i = i0; i < i1; ++i) {
      const auto [u, g, first, R] = tiles[i];
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t = run_start[u] + (first + r) / group, h = g * group + (first + r) % group;
        row_index[r] = t * H + h;
        nr[r] = n[t];
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = f32(qp[row_index[r] * D + d]);
      }
      const int64_t* kr = keys.data() + key_start[u];
      const bf16 *kh = kp + g * D, *vh = vp + g * D;
      if (D == 64) {
        attend_tile<4>(qf.data(), R, nr, kh, vh, kr, fscale, scores, acc.data());
      } else if (D == 128) {
        attend_tile<8>(qf.data(), R, nr, kh, vh, kr, fscale, scores, acc.data());
      } else {
        for (int64_t r = 0; r < R; ++r)
          attend_row(qf.data() + r * D, D, kh, vh, kr, nr[r], fscale, scores, acc.data() + r * D);
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) op[row_index[r] * D + d] = bf16(acc[r * D + d]);
    }
  });
  return out;
}

// Every decoder layer of a Llama-family model in one call: the same ops in the same order as
// CausalLM.forward's fused path (so the same bits), without ~10 Python calls per layer, which cost
// ~14% of a batch-1 decode step of the default target. weights holds, per layer, input norm, qkv,
// o, post-attention norm, gate_up, down (the matmul weights packed by pack_linear_weight, or uint8:
// GGUF-quantized, packed by specd/engine/quant.py); biases
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
    auto attn = paged_attention(q, k_caches[j], v_caches[j], block_tables, seq, pos, key_index, scale, window);
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
  m.impl("paged_attention", &paged_attention);
  m.impl("decoder_stack", &decoder_stack);
}
