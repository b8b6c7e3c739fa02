"""Sampling for one engine step: the target sampler, then the rejection sampler (vLLM v1's split).

  SamplingMetadata  the step's inputs, built once from the batch: per-row sampling params
                    as tensors, generators, and the drafts (SpecDecodeMetadata).
  draw_randomness   every uniform (and, on a GPU, Exp(1) row) the sequences with drafts
                    consume, drawn once, up front.
  verify_chains     on a CPU, the greedy sequences and those that sample at a temperature alone
                    with one-hot drafts: the fused walk (kernels/cpu_sampling_ops.cpp) decides
                    what the path below decides, from the same randomness, reading a row only
                    while its chain is accepted;
  Sampler           the target token of each sampled sequence from its last logits row:
                    argmax of the raw logits (greedy); for a sequence without drafts, the
                    inverse CDF at one uniform (plain decoding draws B numbers a step, not
                    B x V); with drafts, the same on a CPU, and on a GPU the exponential race
                    argmax(p / E), which draws exactly from p without a host sync.
  rejection_sample  takes those bonus tokens and only decides acceptance and draws the
                    recovered tokens, with the bonus's randomness (one of the two is
                    emitted). A sequence consumes one uniform a step without drafts, its k
                    uniforms and one more uniform (GPU: one noise row) with k drafts,
                    whatever else is in the step.
  position_walk     a seeded sequence that samples (strict mode): the token at output position j
                    is the inverse CDF of its filtered row at position_uniform(seed, j), with
                    drafts or without; a draft is accepted where it equals that token, so the
                    tokens are plain decoding's for that seed whatever k, drafter or batch (the
                    controller picks its k as for any request), and a one-hot draft x is accepted
                    with probability p(x), as the rejection test would (a sparse q is not used:
                    seeded requests verify every draft as one-hot).
A seeded request in a lossy mode (typical, synthetic) draws from its own generator at a k of its
own (speculator._fixed_k), so its tokens do not depend on what else is in the batch. (One
exception on a CPU: a step holding a token tree takes the general path for every unseeded
sequence, whose float32 probabilities round differently from the walk's weights, so a draw within
~1e-7 of the edge between two tokens may go the other way there.)
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from specd.kernels.rejection_sampler import (SpecDecodeMetadata, draw_from, draw_randomness, inverse_cdf,
                                             rejection_sample, target_rows, to_token_lists)
from specd.kernels.sampling_ops import argmax_rows, fused
from specd.kernels.tree_rejection_sampler import chain_parents, tree_rejection_sample_ref
from specd.sampling import SamplingParams

_NO_TOP_K = torch.iinfo(torch.int64).max  # a rank never reached: top-k off for that row


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SamplingMetadata:
    """One step's sampling inputs. B sampled sequences and R = N + B logits rows: sequence b's
    k_b draft positions, then its last position (the order a verify forward produces)."""

    temperature: torch.Tensor  # [R] float32 (1 on greedy rows: their probabilities go unused)
    top_k: torch.Tensor | None  # [R] int64 (_NO_TOP_K where off); None: no row uses top-k or top-p
    top_p: torch.Tensor | None  # [R] float32
    min_p: torch.Tensor | None  # [R] float32; None: no row uses min-p
    draft_rows: torch.Tensor  # [N] int64: the logits rows of the draft positions
    bonus_rows: torch.Tensor  # [B] int64: the logits row of each sequence's last position
    generators: list[torch.Generator | None]  # [B] seeded requests' own; None: the engine's
    draws: list[bool]  # [B] host: which sequences draw randomness this step
    spec: SpecDecodeMetadata  # drafts (all num_draft 0 without speculation), greedy mask, mode
    any_greedy: bool = True  # host: some sequence is greedy (else no row needs the raw argmax)
    # [B] host: greedy, or sampled at a temperature alone (no top-k, top-p, min-p) with one-hot drafts:
    # what the fused walk of a CPU verifies (Sampler._chains)
    walkable: list[bool] | None = None
    # [B] host: (seed, output position of the step's first token) of a sequence the position walk
    # verifies (position_walk); None elsewhere. None: no sequence does.
    seeded_positions: list[tuple[int, int] | None] | None = None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device | str,
              generators: Sequence[torch.Generator | None] | None = None,
              drafts: Sequence[Sequence[int]] | None = None, draft_q: Sequence | None = None,
              parents: Sequence | None = None, positions: Sequence[int] | None = None,
              **mode) -> SamplingMetadata:
        """From host lists, one entry per sampled sequence; mode: SpecDecodeMetadata's knobs.
        positions: each sequence's output position of the step's first token; given, a seeded
        sampled sequence is verified by the position walk in strict mode (its generator unused)."""
        B = len(params)
        drafts = [[] for _ in range(B)] if drafts is None else drafts
        greedy = [p.greedy for p in params]
        spec = SpecDecodeMetadata.build(drafts, greedy, device, draft_q, parents, **mode)
        seeded = None
        if positions is not None and spec.mode == "strict" and any(p.seed is not None and not p.greedy for p in params):
            seeded = [(p.seed, pos) if p.seed is not None and not p.greedy else None for p, pos in zip(params, positions)]
        synthetic = spec.mode == "synthetic"  # accepts greedy rows' drafts by chance: they draw too
        rows = [p for p, d in zip(params, drafts) for _ in range(len(d) + 1)]
        draft_rows, bonus_rows = target_rows(spec.num_draft_host)
        top_k = top_p = min_p = None
        if any(p.top_k > 0 or p.top_p < 1.0 for p in rows):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else _NO_TOP_K for p in rows], device=device)
            top_p = torch.tensor([p.top_p for p in rows], device=device)
        if any(p.min_p > 0 for p in rows):
            min_p = torch.tensor([p.min_p for p in rows], device=device)

        def tensor(x):
            return torch.tensor(x, dtype=torch.long, device=device)
        return cls(
            temperature=torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in rows], device=device),
            top_k=top_k, top_p=top_p, min_p=min_p,
            draft_rows=tensor(draft_rows), bonus_rows=tensor(bonus_rows),
            generators=[None if generators is None or (seeded and seeded[b]) else generators[b] for b in range(B)],
            draws=[(not g or (synthetic and bool(d))) and not (seeded and seeded[b])
                   for b, (g, d) in enumerate(zip(greedy, drafts))],
            spec=spec, any_greedy=any(greedy),
            # (a position-walk sequence counts as walkable: what the walk draws for it is not read, and it
            # must not send the step's other sequences down the general path)
            walkable=[p.greedy or bool(seeded and seeded[b])
                      or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0 and not (draft_q and draft_q[b]))
                      for b, p in enumerate(params)],
            seeded_positions=seeded)

    @classmethod
    def from_batch(cls, batch, device: torch.device | str, **mode) -> SamplingMetadata:
        """From the scheduled batch (ScheduledSeq entries; those with logits are sampled)."""
        sampled = [e for e in batch if e.num_logits]
        return cls.build([e.seq.params for e in sampled], device, [e.seq.generator for e in sampled],
                         [e.draft_token_ids for e in sampled],
                         [e.drafts.q if e.drafts else None for e in sampled],
                         [e.drafts.parents if e.drafts else None for e in sampled],
                         [len(e.seq.output_token_ids) for e in sampled], **mode)


def apply_sampling_filters(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on float32 logits [R, V] → probabilities [R, V]."""
    return filter_probs(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p)


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """apply_sampling_filters with the per-row settings given: [R, V], [R] each -> [R, V]."""
    vocab = logits.shape[-1]
    x = logits / temperature[:, None]
    if top_k is not None:
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_x = sorted_x.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs_sorted = sorted_x.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        sorted_x = sorted_x.masked_fill(mass_before > top_p[:, None], float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    probs = x.softmax(dim=-1)
    if min_p is not None:
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class StepRandomness(NamedTuple):
    """What one step draws (Sampler.randomness), for whichever path verifies each sequence."""
    plain: list[bool]  # [B] host: sequences that draw without drafts
    plain_u: torch.Tensor | None  # [B] float64: their uniforms (0 elsewhere); None: no sequence draws so
    uniforms: torch.Tensor | None  # [N] float32: the drafted sequences' accept tests
    noise: torch.Tensor | None  # their drawing randomness: [B] float64 uniforms, or [B, V] Exp(1) rows (a GPU)


class SamplerOutput(NamedTuple):
    token_ids: list[list[int]]  # per sampled sequence: accepted drafts, then one recovered/bonus token
    num_accepted: list[int]  # per sampled sequence
    # Steps with token trees: per sampled sequence, the accepted nodes (draft indices, root
    # first), what the scheduler's KV commit moves; None otherwise.
    paths: list[list[int]] | None = None


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        # Shared generator for unseeded requests: reproducible engine runs, batch-dependent draws.
        self.default_generator = make_generator(seed, device)

    @staticmethod
    def sample_target(greedy_tokens: torch.Tensor, probs: torch.Tensor | None, is_greedy: torch.Tensor,
                      noise: torch.Tensor | None) -> torch.Tensor:
        """greedy_tokens [B] (argmax of the raw logits), probs [B, V] | None (all greedy),
        is_greedy [B], noise [B, V] Exp(1) rows or [B] uniforms → the target token of each row [B]."""
        if probs is None:
            return greedy_tokens
        return torch.where(is_greedy, greedy_tokens, draw_from(probs, noise))

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [R, V] float32 → per sampled sequence, the tokens to commit."""
        if not meta.generators:  # only mid-prefill chunks in the step
            return SamplerOutput([], [])
        if meta.seeded_positions is None:
            return self._drawn(logits, meta)
        walked = position_walk(logits, meta)
        if all(meta.seeded_positions):
            return _merged(meta, walked, None)
        return _merged(meta, walked, self._drawn(logits, meta))

    def _drawn(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Every sequence from the step's randomness (those of the position walk: ignored after)."""
        r = self.randomness(logits, meta)
        chains = self._chains(logits, meta, r.noise)
        if chains is not None and all(chains):
            return verify_chains(logits, meta, chains, r)
        out = self._sample(logits, meta, r)
        if chains is None or not any(chains):
            return out
        walked = verify_chains(logits, meta, chains, r)
        return SamplerOutput(*([w if c else t for w, t, c in zip(walked_part, torch_part, chains)]
                               for walked_part, torch_part in zip(walked[:2], out[:2])))

    def randomness(self, logits: torch.Tensor, meta: SamplingMetadata) -> StepRandomness:
        """Every random number the step consumes, drawn once, whichever path then verifies a sequence.
        A sequence without drafts draws its token by the inverse CDF at one uniform whatever else is
        in the step (so a seeded one consumes the same randomness alone or in any batch)."""
        spec = meta.spec
        plain = [d and k == 0 for d, k in zip(meta.draws, spec.num_draft_host)]
        plain_u = None  # [B] their uniforms (0 on other rows)
        if not spec.all_greedy and any(plain):
            plain_u = draw_row_uniforms(meta.generators, plain, logits.device, self.default_generator)
        uniforms = noise = None
        if spec.max_num_draft and any(meta.draws):  # sequences with drafts: their uniforms and drawing randomness
            drafted = [d and k > 0 for d, k in zip(meta.draws, spec.num_draft_host)]
            uniforms, noise = draw_randomness(meta.generators, spec.num_draft_host, logits.shape[-1],
                                              logits.device, self.default_generator, drafted)
        return StepRandomness(plain, plain_u, uniforms, noise)

    @staticmethod
    def _chains(logits: torch.Tensor, meta: SamplingMetadata, noise: torch.Tensor | None) -> list[bool] | None:
        """Per sequence, whether the fused walk (verify_chains) verifies it: a CPU with the ops, the
        strict chain sampler drawing by the inverse CDF, and a sequence that is greedy or samples at a
        temperature alone with one-hot drafts (meta.walkable); None where no sequence can, or where
        the step is greedy without drafts."""
        spec = meta.spec
        if not fused(logits) or spec.mode != "strict" or spec.has_tree or (noise is not None and noise.dim() != 1):
            return None
        if spec.all_greedy and spec.max_num_draft == 0:  # argmax_rows alone: the walk's setup would cost more
            return None
        return meta.walkable

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, r: StepRandomness) -> SamplerOutput:
        """Every sequence by the filtered probabilities of every row (the general path: top-k, top-p,
        min-p, sparse q, trees, lossy modes, a GPU), from the step's randomness (randomness())."""
        spec = meta.spec
        plain, plain_u, uniforms, noise = r
        probs = None if spec.all_greedy else apply_sampling_filters(logits, meta)  # [R, V]
        # Greedy from the raw logits: softmax can round two close logits to one probability.
        # Without greedy sequences nothing reads it (a pass over every verify row).
        greedy_tokens = (argmax_rows(logits) if meta.any_greedy
                         else torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))  # [R]
        if spec.max_num_draft == 0:  # every row is a last row: no drafts to verify
            tokens = (greedy_tokens if plain_u is None
                      else torch.where(spec.is_greedy, greedy_tokens, inverse_cdf(probs, plain_u)))
            return SamplerOutput([[t] for t in tokens.tolist()], [0] * len(meta.generators))
        # Rows by index_select: advanced indexing copied 49k-wide rows ~10x slower on the 2-core EPYC.
        bonus_probs = None if probs is None else probs.index_select(0, meta.bonus_rows)
        if spec.has_tree:
            # A step with a token tree verifies every sequence by the tree walk (a chain is the
            # tree [-1, 0, 1, ..]: the same decisions), which draws its last token itself.
            tokens, n_acc, paths = tree_rejection_sample_ref(spec, probs, greedy_tokens, uniforms, noise)
            if plain_u is not None:
                direct = inverse_cdf(bonus_probs, plain_u).tolist()
                tokens = [[t] if p else ts for ts, p, t in zip(tokens, plain, direct)]
            return SamplerOutput(tokens, n_acc, paths)
        if plain_u is None:
            bonus = self.sample_target(greedy_tokens[meta.bonus_rows], bonus_probs, spec.is_greedy, noise)
        else:
            is_plain = torch.tensor(plain, device=logits.device)
            if noise.dim() == 1:  # drafted rows draw by the inverse CDF too: one pass over the bonus rows
                bonus = self.sample_target(greedy_tokens[meta.bonus_rows], bonus_probs, spec.is_greedy,
                                           torch.where(is_plain, plain_u, noise))
            else:
                bonus = torch.where(is_plain, inverse_cdf(bonus_probs, plain_u),
                                    self.sample_target(greedy_tokens[meta.bonus_rows], bonus_probs,
                                                       spec.is_greedy, noise))
        out = rejection_sample(spec, None if probs is None else probs.index_select(0, meta.draft_rows),
                               greedy_tokens[meta.draft_rows], bonus, uniforms, noise)
        return SamplerOutput(to_token_lists(out.output_token_ids), out.num_accepted.tolist())


def verify_chains(logits: torch.Tensor, meta: SamplingMetadata, which: list[bool], r: StepRandomness) -> SamplerOutput:
    """The sequences in `which` verified by the fused walk over their rows (kernels/cpu_sampling_ops.cpp):
    what _sample decides for them, from the same randomness, reading a row only while its chain of
    drafts is still accepted and writing no probabilities (a batch-8 step at T 0.7 with 4 drafts each,
    all accepted: 12.6 ms on _sample's softmax of every row and copies, 1.6 ms here;
    bench/results/sampler_cpu.md)."""
    spec, dev = meta.spec, logits.device
    _, plain_u, uniforms, noise = r
    B = len(which)
    draw_u = torch.zeros(B, dtype=torch.float64, device=dev)
    if noise is not None:
        draw_u = noise.double()
    if plain_u is not None:
        draw_u = torch.where(spec.num_draft == 0, plain_u, draw_u)
    if uniforms is None:
        uniforms = torch.zeros(spec.draft_token_ids.shape[0], device=dev)
    temperature = torch.where(spec.is_greedy, 0.0, meta.temperature.index_select(0, meta.bonus_rows))
    out, accepted = torch.ops.specd_cpu.verify_chains(
        logits, meta.bonus_rows - spec.num_draft, spec.num_draft, spec.draft_token_ids, spec.cu_num_draft[:-1],
        temperature.float(), uniforms, draw_u, torch.tensor(which, dtype=torch.bool))
    return SamplerOutput(to_token_lists(out), accepted.tolist())


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that draws output position `position` of a request seeded with `seed`
    (position_walk): a function of the two alone, so plain and speculative steps, any batch and any
    k read the same number for the same token. Its own person string: never a draft's seed
    (draft_seed), so a drafter's draws are not the verifier's."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8, person=b"specd-sample").digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0 ** -53


def position_walk(logits: torch.Tensor, meta: SamplingMetadata) -> dict[int, tuple[list[int], int, list[int]]]:
    """The sequences of meta.seeded_positions, verified position by position: from the root, the
    target token of the current row (its filtered probabilities' inverse CDF at position_uniform of
    that position); the walk moves to the child draft equal to it and stops where none is, emitting
    it. Every emitted token is what plain decoding with this seed emits there (bit for bit where the
    forward is batch-invariant, as greedy output is: the server's `exact`), so the output does not
    depend on the drafts, and each draft x is accepted with probability p(x) (a one-hot draft's
    rejection test). A row is read only while the walk is on it.
    -> {b: (tokens, accepted drafts, accepted nodes)}."""
    spec = meta.spec
    drafts = spec.draft_token_ids.tolist()
    out, node0, row0 = {}, 0, 0
    for b, n in enumerate(spec.num_draft_host):  # sequence b's rows: row0 .. row0 + n (target_rows)
        key = meta.seeded_positions[b]
        if key is not None:
            seed, position = key
            parents = (spec.parents[b] if spec.parents is not None else None) or chain_parents(n)
            children: list[list[int]] = [[] for _ in range(n + 1)]  # by row: 0 the root, 1 + i node i
            for i, parent in enumerate(parents):
                children[parent + 1].append(i)
            path, cur = [], 0
            while True:
                token = _row_token(logits, meta, row0 + cur, position_uniform(seed, position + len(path)))
                nxt = next((i for i in children[cur] if drafts[node0 + i] == token), None)
                if nxt is None:
                    break
                path.append(nxt)
                cur = nxt + 1
            out[b] = ([drafts[node0 + i] for i in path] + [token], len(path), path)
        node0 += n
        row0 += n + 1
    return out


def _row_token(logits: torch.Tensor, meta: SamplingMetadata, row: int, u: float) -> int:
    """Row `row`'s token at the uniform u: its filtered probabilities' inverse CDF (one row at a time,
    so a row's probabilities do not depend on the other rows of the step)."""
    r = slice(row, row + 1)
    probs = filter_probs(logits[r], meta.temperature[r], None if meta.top_k is None else meta.top_k[r],
                         None if meta.top_p is None else meta.top_p[r], None if meta.min_p is None else meta.min_p[r])
    return int(inverse_cdf(probs, torch.tensor([u], dtype=torch.float64, device=logits.device))[0])


def _merged(meta: SamplingMetadata, walked: dict, drawn: SamplerOutput | None) -> SamplerOutput:
    """The position walk's sequences from `walked`, the others from `drawn`; accepted nodes where the
    step has a token tree."""
    B = len(meta.generators)
    tokens = [walked[b][0] if b in walked else drawn.token_ids[b] for b in range(B)]
    accepted = [walked[b][1] if b in walked else drawn.num_accepted[b] for b in range(B)]
    if not meta.spec.has_tree:
        return SamplerOutput(tokens, accepted)
    paths = [walked[b][2] if b in walked else drawn.paths[b] for b in range(B)]
    return SamplerOutput(tokens, accepted, paths)


def draw_row_uniforms(generators: Sequence[torch.Generator | None], draws: Sequence[bool], device,
                      default_generator: torch.Generator) -> torch.Tensor:
    """One uniform per row [B] float64: a seeded row's from its own generator (its draw does not
    depend on the batch), the others' in one draw from the engine's; 0 where a row draws nothing."""
    u = torch.zeros(len(generators), dtype=torch.float64, device=device)
    shared = [b for b, (g, d) in enumerate(zip(generators, draws)) if d and g is None]
    if shared:
        u[torch.tensor(shared, device=device)] = torch.rand(len(shared), dtype=torch.float64, device=device,
                                                            generator=default_generator)
    for b, (g, d) in enumerate(zip(generators, draws)):
        if d and g is not None:
            u[b] = torch.rand(1, dtype=torch.float64, device=device, generator=g)[0]
    return u


def draft_seed(seed: int, position: int) -> int:
    """The seed of the draft at `position` of a request seeded with `seed`.

    Keyed by position, not a stream per request: a resync rebuilds the drafter's state, and a
    stream restarted from the request seed would replay randomness that already drew drafts the
    verifier saw. A position is drafted again only when its earlier draft was never verified
    (an earlier draft was rejected), so its randomness shaped nothing committed. Hashed, so it
    is never the verifier's own stream for that seed (drafts correlated with the acceptance
    uniforms would break exactness)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8, person=b"specd-draft").digest()
    return int.from_bytes(digest, "little") >> 1
