"""kernels/cpu_sampling_ops.cpp against torch: the sampler's argmax and inverse-CDF draw, and the
fused walk that verifies chains of drafts (verify_chains) against the sampler's torch path.

The draws' distributions are tested through the sampler in test_rejection_sampler_distribution.py
(chi-square, which runs these ops wherever they are built); here each op is checked to pick what
torch picks, row by row, on the edges: ties, masked and NaN rows, widths that are not a multiple
of the ops' chunks, a point u on a token's boundary, weights of 0.
"""
import pytest
import torch

from specd.engine.sampler import Sampler, SamplingMetadata
from specd.kernels import cpu_ops
from specd.kernels.sampling_ops import inverse_cdf_torch
from specd.sampling import SamplingParams

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


def chain_step(seed: int, vocab: int, temperatures: list[float]) -> tuple[torch.Tensor, SamplingMetadata]:
    """Logits of one verify step: sequence b has b % 5 drafts (0-4), each its row's sharp favourite
    with probability 0.7 (so chains run on and stop), some tokens masked to -inf (a grammar's mask)."""
    g = torch.Generator().manual_seed(seed)
    drafts = [torch.randint(0, vocab, (b % 5,), generator=g).tolist() for b in range(len(temperatures))]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab, generator=g) * 3
    logits[torch.rand(logits.shape, generator=g) < 0.05] = float("-inf")
    row = 0
    for d in drafts:
        for j, t in enumerate(d):
            if torch.rand(1, generator=g) < 0.7:
                logits[row + j, t] = 25.0
        row += len(d) + 1
    params = [SamplingParams(temperature=t) for t in temperatures]
    return logits, SamplingMetadata.build(params, "cpu", drafts=drafts)


@pytest.mark.parametrize("vocab", [7, 1000, 49155])
def test_verify_chains_decides_what_the_torch_path_decides(vocab):
    """Greedy and sampled sequences (T 0.7 and 1.3) in one step, from the same randomness: the walk
    emits the torch path's tokens (softmax of every row, the rejection sampler) for every sequence.
    Its weights are a polynomial exp of its own, so a point within ~1e-7 of a boundary could go the
    other way; over these steps none does."""
    for seed in range(40 if vocab < 49155 else 6):
        logits, meta = chain_step(seed, vocab, [0.0, 0.7, 1.3, 0.7, 0.0, 0.7, 1.3, 0.7, 0.7, 0.0])
        spec = meta.spec
        walk = Sampler(torch.device("cpu"), seed=seed)
        got = walk(logits, meta)
        assert walk._chains(logits, meta, None) == [True] * 10  # the walk took every sequence
        ref = Sampler(torch.device("cpu"), seed=seed)
        want = ref._sample(logits, meta, ref.randomness(logits, meta))
        assert got.token_ids == want.token_ids and got.num_accepted == want.num_accepted, seed
        assert 0 < sum(got.num_accepted) < sum(spec.num_draft_host)  # chains both ran on and stopped


def test_a_step_mixing_filtered_and_plain_sampling_takes_each_sequence_its_way():
    """Sequences with top-p or top-k take the general path, the others the walk, in one step: each
    emits what the general path alone would, from the same randomness."""
    for seed in range(20):
        logits, meta = chain_step(seed, 300, [0.7, 0.0, 0.7, 0.7, 1.3, 0.7])
        params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.7),
                  SamplingParams(temperature=1.3, top_k=20), SamplingParams(temperature=0.7)]
        drafts = [meta.spec.draft_token_ids[a:b].tolist() for a, b in
                  zip(meta.spec.cu_num_draft[:-1].tolist(), meta.spec.cu_num_draft[1:].tolist())]
        meta = SamplingMetadata.build(params, "cpu", drafts=drafts)
        walk = Sampler(torch.device("cpu"), seed=seed)
        assert walk._chains(logits, meta, None) == [True, True, False, True, False, True]
        got = walk(logits, meta)
        ref = Sampler(torch.device("cpu"), seed=seed)
        want = ref._sample(logits, meta, ref.randomness(logits, meta))
        assert got.token_ids == want.token_ids and got.num_accepted == want.num_accepted, seed


def test_verify_chains_greedy_is_argmax_rows_on_nan_and_masked_rows():
    """A greedy chain keeps a draft iff it is argmax_rows' token, NaN and all -inf rows included
    (plain greedy decoding takes argmax_rows: speculation must not change a greedy token)."""
    logits = torch.randn(4, 100)
    logits[0, 7] = float("nan")
    logits[1] = float("-inf")
    logits[2, 3] = logits[2, 9] = 50.0  # a tie: the first
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)], "cpu", drafts=[[7, 0, 3]])
    out = Sampler(torch.device("cpu"))(logits, meta)
    assert out.token_ids == [[7, 0, 3, int(ops.argmax_rows(logits[3:]))]] and out.num_accepted == [3]


def test_verify_chains_refuses_bad_inputs():
    logits, meta = chain_step(0, 50, [0.7, 0.7])
    spec = meta.spec
    args = [logits, meta.bonus_rows - spec.num_draft, spec.num_draft, spec.draft_token_ids, spec.cu_num_draft[:-1],
            torch.full((2,), 0.7), torch.zeros(spec.draft_token_ids.shape[0]), torch.zeros(2, dtype=torch.float64),
            torch.ones(2, dtype=torch.bool)]
    ops.verify_chains(*args)
    bad_token = list(args)
    bad_token[3] = torch.full_like(spec.draft_token_ids, 50)
    with pytest.raises(RuntimeError, match="vocabulary"):
        ops.verify_chains(*bad_token)
    bad_rows = list(args)
    bad_rows[1] = args[1] + logits.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        ops.verify_chains(*bad_rows)
    bad_u = list(args)
    bad_u[7] = torch.zeros(2)
    with pytest.raises(RuntimeError, match="float64"):
        ops.verify_chains(*bad_u)
