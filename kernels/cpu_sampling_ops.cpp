// Fused CPU ops for the sampler's passes over vocabulary-wide float32 rows (kernels/cpu_ops.py
// builds and loads them with the others; kernels/sampling_ops.py picks them or torch).
//
// Why: a verify step samples from one row per draft plus one per sequence, each as wide as the
// vocabulary (49,152 for SmolLM2). On the 2-core EPYC (1 thread) torch takes ~0.05 ms a row for
// argmax (its index-returning reduction does not vectorise there) and ~0.1 ms for the inverse
// CDF's float64 cumulative sum and search; a batch-8 step verifying 4 drafts each spent 4.3 ms in
// the sampler greedy and 30 ms at T 0.7, against a ~35 ms forward (0.75 and 9.2 ms with these:
// bench/sampler_cpu.py, bench/results/sampler_cpu.md).
// A softmax here (a polynomial exp, vectorised) was only 1.2x torch's, so torch keeps that one.
//
// Each row is computed alone, in one fixed order: a row's result is the same whatever rows are
// beside it (a seeded request draws the same token alone or in any batch).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
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

// A token drawn from norm(w) at the uniform u in [0, 1): the point x = u * total (kept strictly
// below the total), the block whose running total passes x, then the first token in it whose
// running sum passes x. The sums are float64, as kernels/sampling_ops.py's torch cumulative sum
// is (a float32 sum of 49k terms rounds by ~1e-7), but per block first: one pass that vectorises,
// then a walk over ~770 block totals and one block, instead of a 49k-long dependent chain.
// A token of weight 0 is never drawn: the sum rises where x is passed (and where rounding left
// x past a block's last token, the block's last token of positive weight is taken; the block's
// total is positive, since the running total rose past x there). All weights 0: the last token,
// as searchsorted + clamp gives in the reference.
int64_t inverse_cdf_row(const float* w, int64_t n, double u, std::vector<double>& blocks) {
  const int64_t nb = (n + BLOCK - 1) / BLOCK;
  blocks.resize(nb);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    blocks[b] = block_sum(w + b * BLOCK, std::min(BLOCK, n - b * BLOCK));
    total += blocks[b];
  }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("inverse_cdf(Tensor weights, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("inverse_cdf", &inverse_cdf);
}
