// Paged attention for the fused CPU ops (torch.ops.specd_cpu.paged_attention, and decoder_stack's
// attention): each new token over its keys, read in place from the paged KV cache through the block
// table, in float32, one fixed order per row (the same bits for a token alone or in any step).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_fused_ops.h"
#include "cpu_simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace {

using namespace specd_simd;
using specd_cpu::f32, specd_cpu::vexp;
constexpr int L = LANES;

// sum_i a[i] * b[i]: 16 partial sums (lane l takes i = l, l + 16, ...), then a fixed reduction tree.
inline float dot(const bf16* a, const float* b, int64_t n) {
  V16 part = zero();
  int64_t i = 0;
  for (; i + L <= n; i += L) part = fmadd(load_bf16(a + i), load(b + i), part);
  if (i < n) part = fmadd(load_bf16_first(a + i, n - i), load_first(b + i, n - i), part);
  return reduce_add(part);
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

}  // namespace

namespace specd_cpu {

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
  auto run_rows = [&](int64_t u) { return group * (run_start[u + 1] - run_start[u]); };
  auto count = [&](int64_t size) {
    int64_t c = 0;
    for (int64_t u = 0; u < runs; ++u) c += hkv * ((run_rows(u) + size - 1) / size);
    return c;
  };
  int64_t tile = 1;
  for (int64_t u = 0; u < runs; ++u) tile = std::max(tile, std::min(TILE_ROWS, run_rows(u)));
  while (tile > 1 && count(tile) < 2 * threads) --tile;
  std::vector<std::array<int64_t, 4>> tiles;
  for (int64_t u = 0; u < runs; ++u) {
    const int64_t rows = run_rows(u), parts = (rows + tile - 1) / tile;
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

}  // namespace specd_cpu
