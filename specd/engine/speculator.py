"""The speculative part of an engine step: propose drafts before the forward, accept after.

propose: the controller picks k per decoding sequence, the proposer (the same objects
  the drafter service hosts) drafts, and the drafts join the ragged batch as extra
  query positions: [last token, d1 .. dk], all with logits.
accept:  one batched rejection-sampling call over every sampled sequence (a sequence
  without drafts is just "bonus" sampling), with randomness drawn from each request's
  own generator so seeded requests reproduce whatever the batch.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict

import torch

from specd.config import SpeculativeConfig
from specd.engine.block_manager import BlockManager
from specd.engine.sampler import apply_sampling_filters
from specd.engine.scheduler import ScheduledSeq
from specd.engine.sequence import Sequence
from specd.engine.spec_controller import SpecController
from specd.engine.spec_stats import SpecStats


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, vocab_size: int, max_model_len: int,
                 block_manager: BlockManager, device: torch.device, default_generator: torch.Generator):
        self.config, self.proposer = config, proposer
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.blocks, self.device = block_manager, device
        self.default_generator = default_generator
        self.controller = SpecController(config.num_speculative_tokens, config.adaptive)
        self.lossy = config.rejection_sample_method != "strict"
        # Counters per drafter (the in-process proposer counts as its method): the verifier
        # exports them as Prometheus counters labelled by drafter.
        self.stats_by_drafter: dict[str, SpecStats] = defaultdict(SpecStats)

    # -- propose ---------------------------------------------------------------
    def propose(self, batch: list[ScheduledSeq], budget_left: int) -> None:
        from specd.proposers.base import ProposeRequest

        decoding = [e for e in batch if e.num_new_tokens == 1 and e.num_logits == 1]
        if not decoding:
            return
        caps = [self._cap(e.seq, budget_left) for e in decoding]
        base_tokens = sum(e.num_new_tokens for e in batch)
        ks = self.controller.choose([(e.seq.seq_id, cap, self._fixed_k(e.seq)) for e, cap in zip(decoding, caps)],
                                    base_tokens)
        requests, entries = [], []
        for e, k in zip(decoding, ks):
            if k <= 0:
                continue
            seq = e.seq
            full = seq.spec_sent == 0
            tokens = seq.token_ids
            requests.append(ProposeRequest(seq_id=seq.seq_id, new_tokens=tokens[seq.spec_sent:],
                                           num_tokens=len(tokens), k=k, full_history=full,
                                           num_prompt_tokens=len(seq.prompt_token_ids),
                                           temperature=seq.params.temperature, seed=seq.params.seed))
            entries.append(e)
            seq.spec_sent = len(tokens)
        if not requests:
            return
        t0 = time.perf_counter()
        proposals = self.proposer.propose(requests)
        if any(p.token_ids for p in proposals):
            # A call that drafted nothing (a drafter past its deadline, down, or out of sync)
            # says nothing about drafting cost; timed, one 250 ms deadline would price drafting
            # out for long after the drafter recovered.
            self.controller.observe_draft(max(r.k for r in requests), len(requests), time.perf_counter() - t0)
        by_id = {p.seq_id: p for p in proposals}
        for e, req in zip(entries, requests):
            p = by_id.get(e.seq.seq_id)
            if p is None or p.resync:
                e.seq.spec_sent = 0  # resend the full history next time
                continue
            drafts, q = self._validated(p, req.k)
            if drafts and self.blocks.allocate(e.seq, e.seq.num_computed_tokens + 1 + len(drafts)):
                e.draft_token_ids, e.draft_q = drafts, q
                e.drafter = p.drafter or self.config.method
                e.num_new_tokens = e.num_logits = 1 + len(drafts)

    def _fixed_k(self, seq: Sequence) -> int | None:
        """The request's own k, if any; seeded requests always draft at full k (batch-independent)."""
        if seq.params.num_speculative_tokens is not None:
            return seq.params.num_speculative_tokens
        return self.config.num_speculative_tokens if seq.params.seed is not None else None

    def _cap(self, seq: Sequence, budget_left: int) -> int:
        # Never draft past max_tokens or max_model_len: k drafts can commit k + 1 tokens.
        room_tokens = seq.params.max_tokens - len(seq.output_token_ids) - 1
        room_context = self.max_model_len - len(seq) - 1
        cap = min(self.config.num_speculative_tokens, room_tokens, room_context)
        # A seeded request's k must not depend on the batch (it decides how much of the
        # request's randomness each step consumes), so the shared token budget skips it.
        if seq.params.seed is None:
            cap = min(cap, budget_left)
        return max(0, cap)

    def _validated(self, p, k: int):
        """Drafts cut at the first bad entry: a proposer never corrupts output, it only costs drafts."""
        drafts = []
        for t in p.token_ids[:k]:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                break
            drafts.append(t)
        q = None
        if p.q_ids:  # sampled drafts: the sparse q must be a distribution that contains the draft
            ok = p.q_probs is not None and len(p.q_ids) >= len(drafts) and len(p.q_probs) >= len(drafts)
            q = list(zip(p.q_ids, p.q_probs or []))[: len(drafts)] if ok else []
            if not ok or not all(self._valid_q(t, ids, probs) for t, (ids, probs) in zip(drafts, q)):
                return [], None
        return drafts, q

    def _valid_q(self, draft: int, ids: list[int], probs: list[float]) -> bool:
        if not ids or len(ids) != len(probs) or len(set(ids)) != len(ids):
            return False
        if not all(0 <= i < self.vocab_size for i in ids) or not all(math.isfinite(x) and x >= 0 for x in probs):
            return False
        return abs(sum(probs) - 1.0) < 1e-3 and probs[ids.index(draft)] > 0 if draft in ids else False

    # -- accept ----------------------------------------------------------------
    def accept(self, batch: list[ScheduledSeq], logits: torch.Tensor):
        """logits [Σ num_logits, V] → per sampled entry, the tokens to commit (accepted + 1)."""
        from specd.kernels.rejection_sampler import rejection_sample

        sampled = [e for e in batch if e.num_logits]
        num_draft = [len(e.draft_token_ids) for e in sampled]
        params = [e.seq.params for e in sampled]
        all_greedy = all(p.greedy for p in params)
        if all_greedy and self.config.rejection_sample_method != "synthetic":  # argmax of the raw logits decides; no distribution, no randomness
            probs, uniforms, noise = logits, None, None
        else:
            row_params = [p for p, n in zip(params, num_draft) for _ in range(n + 1)]
            probs = apply_sampling_filters(logits, row_params)
            uniforms, noise = self._randomness(sampled, num_draft)
        draft_ids = torch.tensor([t for e in sampled for t in e.draft_token_ids], dtype=torch.long,
                                 device=self.device)
        q_ids, q_probs = self._sparse_q(sampled, num_draft)
        out, num_accepted, _ = rejection_sample(
            probs, draft_ids, torch.tensor(num_draft, dtype=torch.long, device=self.device), q_ids, q_probs,
            torch.tensor([p.greedy for p in params], device=self.device), uniforms, noise,
            target_logits=logits,
            max_num_draft=max(num_draft),
            all_greedy=all_greedy,
            mode=self.config.rejection_sample_method,
            posterior_threshold=self.config.posterior_threshold,
            posterior_alpha=self.config.posterior_alpha,
            synthetic_acceptance_rate=self.config.synthetic_acceptance_rate or 0.0,
        )
        rows, accepted = out.tolist(), num_accepted.tolist()
        tokens = []
        for e, row, n_acc, n in zip(sampled, rows, accepted, num_draft):
            tokens.append(row[: n_acc + 1])
            self.controller.observe_accept(e.seq.seq_id, n, n_acc)
            e.seq.spec_stats.observe_draft(n, n_acc)
            if n:
                self.stats_by_drafter[e.drafter or self.config.method or "unknown"].observe_draft(n, n_acc)
        return tokens, num_accepted

    def _sparse_q(self, sampled, num_draft):
        if not any(e.draft_q for e in sampled):
            return None, None  # every draft deterministic: q is one-hot
        width = max(len(ids) for e in sampled if e.draft_q for ids, _ in e.draft_q)
        n = sum(num_draft)
        q_ids = torch.full((n, width), -1, dtype=torch.long)
        q_probs = torch.zeros((n, width), dtype=torch.float32)
        row = 0
        for e in sampled:
            for i, t in enumerate(e.draft_token_ids):
                ids, probs = e.draft_q[i] if e.draft_q else ([t], [1.0])
                q_ids[row, : len(ids)] = torch.tensor(ids)
                q_probs[row, : len(ids)] = torch.tensor(probs, dtype=torch.float32)
                row += 1
        return q_ids.to(self.device), q_probs.to(self.device)

    def _randomness(self, sampled, num_draft):
        uniforms = torch.zeros(sum(num_draft), device=self.device)
        noise = torch.ones(len(sampled), self.vocab_size, device=self.device)
        row = 0
        for i, (e, n) in enumerate(zip(sampled, num_draft)):
            synthetic = self.config.rejection_sample_method == "synthetic"  # accepts greedy rows by chance too
            if not e.seq.params.greedy or synthetic:
                gen = e.seq.generator or self.default_generator
                uniforms[row: row + n].uniform_(generator=gen)
                noise[i].exponential_(generator=gen)
            row += n
        return uniforms, noise

    def release(self, seq: Sequence) -> None:
        self.controller.release(seq.seq_id)
        if seq.spec_sent:
            self.proposer.release([seq.seq_id])
