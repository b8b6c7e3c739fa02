"""kernels/cpu_sampling_ops.cpp against torch: the sampler's argmax and inverse-CDF draw.

The draws' distributions are tested through the sampler in test_rejection_sampler_distribution.py
(chi-square, which runs these ops wherever they are built); here each op is checked to pick what
torch picks, row by row, on the edges: ties, masked and NaN rows, widths that are not a multiple
of the ops' chunks, a point u on a token's boundary, weights of 0.
"""
import pytest
import torch

from specd.kernels import cpu_ops
from specd.kernels.sampling_ops import inverse_cdf_torch

pytestmark = pytest.mark.skipif(not cpu_ops.cpu_supported(), reason="the fused CPU ops need x86-64 Linux with AVX-512 or AVX2 + FMA")
ops = torch.ops.specd_cpu
WIDTHS = [1, 7, 64, 1000, 49152, 49155]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.available(), "the fused CPU ops did not build on a CPU that supports them"


@pytest.mark.parametrize("width", WIDTHS)
def test_argmax_is_torchs_first_maximum(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(12, width, generator=g)
    x[1] = 0.5  # every entry tied: the first
    x[2, width // 2:] = x[2].max() + 1  # a tie from the middle on: its first
    x[3] = float("-inf")  # masked everywhere (a grammar's dead end): the first
    x[4] = float("-inf")
    x[4, -1] = -3.0  # one entry left, the last
    x[5, width // 3] = float("nan")  # torch's rule: a NaN is the largest
    x[6, -1], x[6, 0] = float("nan"), float("nan")
    x[7, width - 1] = 1e30  # the maximum in the tail past the last whole chunk
    x[8] = torch.randint(0, 3, (width,), generator=g).float()  # many ties at the maximum
    got = ops.argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    # each row alone gives what it gives in the batch: nothing depends on the rows beside it
    assert all(ops.argmax_rows(x[r:r + 1]).item() == got[r].item() for r in range(x.shape[0]))


@pytest.mark.parametrize("width", WIDTHS)
def test_inverse_cdf_draws_what_the_float64_cumulative_sum_draws(width):
    g = torch.Generator().manual_seed(width)
    rows = 400
    logits = torch.randn(rows, width, generator=g) * torch.linspace(0.1, 8, rows)[:, None]  # flat .. peaked
    probs = logits.softmax(dim=-1)
    probs[::3] *= torch.rand(probs[::3].shape, generator=g) < 0.3  # sparse rows (filtered, residuals): unnormalised
    probs[::3, 0] += 1e-3  # never all zero here
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    u[0], u[1] = 0.0, 1.0 - 2 ** -53  # the two ends of [0, 1)
    got = ops.inverse_cdf(probs, u)
    assert torch.equal(got, inverse_cdf_torch(probs, u))
    assert (probs.gather(1, got[:, None]) > 0).all()
    assert all(ops.inverse_cdf(probs[r:r + 1], u[r:r + 1]).item() == got[r].item() for r in range(0, rows, 37))


def test_inverse_cdf_on_every_boundary_of_a_row_with_gaps():
    # Weights in dyadic fractions (exact sums), zeros between them: at u exactly on each cumulative
    # boundary the next token of positive weight is drawn, just below it the one before, and a
    # token of weight 0 never.
    width = 300
    probs = torch.zeros(1, width)
    positive = [3, 64, 65, 127, 200, 299]
    for i, t in enumerate(positive):
        probs[0, t] = 2.0 ** -(i + 1)
    total = probs.double().sum()
    cumulative = probs.double().cumsum(dim=-1)[0]
    for i, t in enumerate(positive):
        below = (cumulative[t] - probs[0, t].double()) / total
        for u in (below, torch.nextafter(cumulative[t] / total, torch.tensor(0.0, dtype=torch.float64))):
            u = u.reshape(1).clamp(0, 1 - 2 ** -53)
            assert ops.inverse_cdf(probs, u).item() == inverse_cdf_torch(probs, u).item() == t, (t, u)
    assert ops.inverse_cdf(torch.zeros(1, width), torch.tensor([0.5], dtype=torch.float64)).item() == width - 1


def test_bad_inputs_are_refused():
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float64"):
        ops.inverse_cdf(torch.ones(2, 8), torch.zeros(2))
