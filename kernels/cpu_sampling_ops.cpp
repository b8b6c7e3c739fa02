// Fused CPU ops for the sampler's passes over vocabulary-wide float32 rows (kernels/cpu_ops.py
// builds and loads them with the others; kernels/sampling_ops.py picks them or torch).
//
// Why: a verify step samples from one row per draft plus one per sequence, each as wide as the
// vocabulary (49,152 for SmolLM2). On the 2-core EPYC (1 thread) torch takes ~0.05 ms a row for
// argmax (its index-returning reduction does not vectorise there) and ~0.1 ms for the inverse
// CDF's float64 cumulative sum and search; a batch-8 step verifying 4 drafts each spent 4.3 ms in
// the sampler greedy and 30 ms at T 0.7, against a ~35 ms forward (0.75 and 9.2 ms with argmax
// and the inverse CDF fused). What was left at T 0.7 was the softmax of every row and copies of
// them; verify_chains reads a row only while its chain of drafts is accepted and never writes
// probabilities: 12.6 -> 1.6 ms for that step with every draft accepted (every row read) on a
// Xeon with AVX-512, 1 thread (bench/sampler_cpu.py, bench/results/sampler_cpu.md).
//
// Each row is computed alone, in one fixed order: a row's result is the same whatever rows are
// beside it (a seeded request draws the same token alone or in any batch).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK = 64;  // the inverse CDF's blocks: a total per block, then a walk inside one

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu(),
              name, " must be a 2-D CPU float32 tensor");
}

// First index of the row's largest value m (torch.argmax's choice among ties); a NaN counts as
// the largest (torch's rule: amax is NaN then), so a row holding one gives its first NaN.
// Chunks of 64 are tested whole first: that loop vectorises, an early-exit one does not (~20x).
int64_t first_index_of(const float* x, int64_t n, float m) {
  const bool nan = m != m;
  int64_t j0 = 0;
  for (; j0 + 64 <= n; j0 += 64) {
    int hit = 0;
    for (int j = 0; j < 64; ++j) hit |= nan ? x[j0 + j] != x[j0 + j] : x[j0 + j] == m;
    if (hit) break;
  }
  for (int64_t j = j0; j < n; ++j)
    if (nan ? x[j] != x[j] : x[j] == m) return j;
  return 0;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_rows(logits, "logits");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  // torch's amax vectorises (~6 us a 49k row on the EPYC, 1 thread); what it lacks is the index.
  auto maxima = x.amax(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float *xp = x.data_ptr<float>(), *mp = maxima.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = first_index_of(xp + r * n, n, mp[r]);
  });
  return out;
}

// The row's weights summed in float64 per block of 64 (8 partial sums folded in a fixed order).
double block_sum(const float* w, int64_t n) {
  double part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += static_cast<double>(w[i + l]);
  for (int l = 0; i < n; ++i, ++l) part[l] += static_cast<double>(w[i]);
  for (int s = 4; s > 0; s /= 2)
    for (int l = 0; l < s; ++l) part[l] += part[l + s];
  return part[0];
}

// The row's weights summed in float64 per block of 64 into blocks -> the row's total (the blocks
// summed in order).
double block_totals(const float* w, int64_t n, std::vector<double>& blocks) {
  const int64_t nb = (n + BLOCK - 1) / BLOCK;
  blocks.resize(nb);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    blocks[b] = block_sum(w + b * BLOCK, std::min(BLOCK, n - b * BLOCK));
    total += blocks[b];
  }
  return total;
}

// A token drawn from norm(w) at the uniform u in [0, 1), given w's block totals: the point
// x = u * total (kept strictly below the total), the block whose running total passes x, then the
// first token in it whose running sum passes x. The sums are float64, as kernels/sampling_ops.py's
// torch cumulative sum is (a float32 sum of 49k terms rounds by ~1e-7), but per block first: one
// pass that vectorises, then a walk over ~770 block totals and one block, instead of a 49k-long
// dependent chain. A token of weight 0 is never drawn: the sum rises where x is passed (and where
// rounding left x past a block's last token, the block's last token of positive weight is taken;
// the block's total is positive, since the running total rose past x there). All weights 0: the
// last token, as searchsorted + clamp gives in the reference.
int64_t draw_in_blocks(const float* w, int64_t n, const std::vector<double>& blocks, double total, double u) {
  const int64_t nb = static_cast<int64_t>(blocks.size());
  const double x = std::min(u * total, std::nextafter(total, 0.0));
  double before = 0.0;
  int64_t b = 0;
  for (; b < nb && !(before + blocks[b] > x); ++b) before += blocks[b];
  if (b == nb) return n - 1;
  const int64_t end = std::min(n, (b + 1) * BLOCK);
  int64_t last = -1;
  for (int64_t i = b * BLOCK; i < end; ++i) {
    if (w[i] > 0.0f) last = i;
    before += static_cast<double>(w[i]);
    if (before > x) return i;
  }
  return last;
}

int64_t inverse_cdf_row(const float* w, int64_t n, double u, std::vector<double>& blocks) {
  const double total = block_totals(w, n, blocks);
  return draw_in_blocks(w, n, blocks, total, u);
}

at::Tensor inverse_cdf(const at::Tensor& weights, const at::Tensor& u) {
  check_rows(weights, "weights");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == weights.size(0) && u.scalar_type() == at::kDouble,
              "u must be float64 [rows]");
  auto w = weights.contiguous();
  auto uc = u.contiguous();
  const int64_t rows = w.size(0), n = w.size(1);
  auto out = at::empty({rows}, w.options().dtype(at::kLong));
  const float* wp = w.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 2, [&](int64_t r0, int64_t r1) {
    std::vector<double> blocks;
    for (int64_t r = r0; r < r1; ++r) op[r] = inverse_cdf_row(wp + r * n, n, up[r], blocks);
  });
  return out;
}


// The largest value of a row, a NaN counting as the largest (torch's amax; first_index_of then finds
// argmax_rows' index). The OpenMP simd reduction is what vectorises it (~4 us a 49k row here, ~18 us
// with 16 running maxima, ~58 us with the NaN test inside the comparison).
float row_max(const float* x, int64_t n) {
  float m = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    nan |= x[i] != x[i];
  }
  return nan ? NAN : m;
}

// exp(x) for x <= 0 in float32 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n put
// in the exponent bits), branch-free so that GCC vectorises the loop calling it (std::exp does not
// vectorise without -ffast-math). Relative error ~2e-7; exp(x) < 2^-126 gives 0.
inline float exp_nonpositive(float x) {
  const float y = std::max(x, -87.0f);
  const float n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (y - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// w = exp((x - max) / T) over a row: the target's distribution at temperature T, unnormalised.
void tempered_weights(const float* x, int64_t n, float inv_t, float* w) {
  const float m = row_max(x, n);
  if (m == -INFINITY) {  // every token masked: all weights 0 (the draw then gives the last token)
    std::fill(w, w + n, 0.0f);
    return;
  }
  for (int64_t i = 0; i < n; ++i) w[i] = exp_nonpositive((x[i] - m) * inv_t);
}

// One sequence's chain of drafts, verified against its rows (drafts' rows, then its last row):
// greedy (T = 0), a draft is kept iff it is its row's argmax and the token after is that argmax;
// sampled, a draft x is kept iff u < p(x) (q one-hot: min(1, p/q) = p), the first one not kept is
// replaced by a draw from norm(max(0, p - q)) = p without x (p itself where rounding left nothing
// else), and where every draft is kept the last row's draw follows, both at the sequence's one
// drawing uniform. Rows past the first rejected draft are never read: at T > 0 this is what saves
// the softmax of every verify row. -> accepted drafts; out gets the emitted tokens.
int64_t verify_chain(const float* rows, int64_t n, const int64_t* drafts, int64_t k, float temperature,
                     const float* u, double draw_u, int64_t* out, std::vector<float>& w,
                     std::vector<double>& blocks) {
  if (temperature <= 0.0f) {
    for (int64_t j = 0; j <= k; ++j) {
      const float* x = rows + j * n;
      const int64_t best = first_index_of(x, n, row_max(x, n));
      out[j] = best;
      if (j == k || best != drafts[j]) return j;
    }
  }
  w.resize(n);
  const float inv_t = 1.0f / temperature;
  for (int64_t j = 0; j <= k; ++j) {
    tempered_weights(rows + j * n, n, inv_t, w.data());
    double total = block_totals(w.data(), n, blocks);
    if (j < k) {
      const int64_t x = drafts[j];
      if (static_cast<double>(u[j]) * total < static_cast<double>(w[x])) {  // u < p(x)
        out[j] = x;
        continue;
      }
      const float wx = w[x];
      w[x] = 0.0f;
      const int64_t b = x / BLOCK;
      blocks[b] = block_sum(w.data() + b * BLOCK, std::min(BLOCK, n - b * BLOCK));
      double rest = 0.0;
      for (double t : blocks) rest += t;
      if (rest > 0.0) {
        total = rest;
      } else {  // p(x) rounded to 1: the residual is p
        w[x] = wx;
        total = block_totals(w.data(), n, blocks);
      }
    }
    out[j] = draw_in_blocks(w.data(), n, blocks, total, draw_u);
    return j;
  }
  return k;
}

// A step's sequences verified by verify_chain, in parallel, each from its own rows and randomness.
// logits [R, V]: sequence b's num_draft[b] draft rows then its last row, from row_start[b];
// drafts [N] from draft_start[b]; temperature [B] (0: greedy); uniforms [N] float32; draw_u [B]
// float64; active [B]: the sequences to verify (the others are left -1, 0).
std::vector<at::Tensor> verify_chains(const at::Tensor& logits, const at::Tensor& row_start,
                                      const at::Tensor& num_draft, const at::Tensor& drafts,
                                      const at::Tensor& draft_start, const at::Tensor& temperature,
                                      const at::Tensor& uniforms, const at::Tensor& draw_u,
                                      const at::Tensor& active) {
  check_rows(logits, "logits");
  const int64_t B = num_draft.size(0);
  for (const auto* t : {&row_start, &num_draft, &draft_start})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong, "row_start, num_draft and "
                "draft_start must be int64 [B]");
  TORCH_CHECK(drafts.dim() == 1 && drafts.scalar_type() == at::kLong, "drafts must be int64 [N]");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == drafts.size(0) && uniforms.scalar_type() == at::kFloat,
              "uniforms must be float32 [N]");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == B && temperature.scalar_type() == at::kFloat,
              "temperature must be float32 [B]");
  TORCH_CHECK(draw_u.dim() == 1 && draw_u.size(0) == B && draw_u.scalar_type() == at::kDouble,
              "draw_u must be float64 [B]");
  TORCH_CHECK(active.dim() == 1 && active.size(0) == B && active.scalar_type() == at::kBool, "active must be bool [B]");
  auto x = logits.contiguous();
  // The small inputs are read through their pointers: contiguous copies where a caller passed views.
  auto rsc = row_start.contiguous(), ndc = num_draft.contiguous(), dsc = draft_start.contiguous();
  auto dtc = drafts.contiguous(), onc = active.contiguous(), tc = temperature.contiguous();
  auto uc = uniforms.contiguous(), duc = draw_u.contiguous();
  const int64_t R = x.size(0), n = x.size(1), N = drafts.size(0);
  const int64_t* rs = rsc.data_ptr<int64_t>();
  const int64_t* nd = ndc.data_ptr<int64_t>();
  const int64_t* ds = dsc.data_ptr<int64_t>();
  const int64_t* dt = dtc.data_ptr<int64_t>();
  const bool* on = onc.data_ptr<bool>();
  int64_t K = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (!on[b]) continue;
    // (A constant message: built with an integer in it, a failed check crashed the process under
    // torch 2.11 on an H200 machine's Xeon, where the other checks raised.)
    TORCH_CHECK(nd[b] >= 0 && rs[b] >= 0 && rs[b] + nd[b] < R && ds[b] >= 0 && ds[b] + nd[b] <= N,
                "a sequence's rows or drafts are out of range");
    for (int64_t j = 0; j < nd[b]; ++j)
      TORCH_CHECK(dt[ds[b] + j] >= 0 && dt[ds[b] + j] < n, "draft token out of the vocabulary");
    K = std::max(K, nd[b]);
  }
  auto out = at::full({B, K + 1}, -1, x.options().dtype(at::kLong));
  auto accepted = at::zeros({B}, x.options().dtype(at::kLong));
  const float *xp = x.data_ptr<float>(), *tp = tc.data_ptr<float>(), *up = uc.data_ptr<float>();
  const double* dp = duc.data_ptr<double>();
  int64_t *op = out.data_ptr<int64_t>(), *ap = accepted.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w;
    std::vector<double> blocks;
    for (int64_t b = b0; b < b1; ++b)
      if (on[b])
        ap[b] = verify_chain(xp + rs[b] * n, n, dt + ds[b], nd[b], tp[b], up + ds[b], dp[b], op + b * (K + 1), w,
                             blocks);
  });
  return {out, accepted};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("inverse_cdf(Tensor weights, Tensor u) -> Tensor");
  m.def("verify_chains(Tensor logits, Tensor row_start, Tensor num_draft, Tensor drafts, Tensor draft_start, "
        "Tensor temperature, Tensor uniforms, Tensor draw_u, Tensor active) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(specd_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("inverse_cdf", &inverse_cdf);
  m.impl("verify_chains", &verify_chains);
}
