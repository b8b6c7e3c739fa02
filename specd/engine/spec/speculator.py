"""The speculative part of an engine step: drafts before the forward, counters after.

propose: in-process index drafters (suffix, ngram: a lookup of microseconds, answers_inline)
  are asked first, every step, for every decoding sequence at its full k; the controller then
  picks k and the drafter per sequence knowing what they offered, the other proposers (the
  same objects the drafter service hosts, or a verifier's pool of drafter services) draft
  for the sequences it sent to them, and the validated drafts go back to the engine as
  Drafts per sequence; the scheduler attaches them to the batch ([last token, d1 .. dk],
  all with logits). Verification is the sampler's (specd.engine.sampler).
observe: acceptance per sequence feeds the controller and the per-drafter counters.
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from dataclasses import replace

from specd.config import DEFAULT_TREE_NODES, SpeculativeConfig
from specd.engine.scheduler import Drafts, ScheduledSeq
from specd.engine.sequence import Sequence
from specd.engine.spec.controller import SpecController
from specd.engine.spec.proposal import ProposeRequest
from specd.engine.spec_stats import SpecStats

log = logging.getLogger("specd.speculation")
# Where none of an in-process index's drafts could pay (a CPU at batch 32), it is still asked every
# this many steps: the plan may take or explore what it offers, so its acceptance keeps being measured.
ASK_ANYWAY_EVERY = 16



def drafting_temperature(params) -> float:
    """The temperature drafters get: 0 for a greedy request, whatever its temperature field says
    (top_k 1 at T 0.7 is greedy: SamplingParams.greedy is the one definition), so a drafter plans
    and drafts it as the verifier verifies it."""
    return 0.0 if params.greedy else params.temperature

class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, vocab_size: int, max_model_len: int):
        self.config, self.proposer = config, proposer
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.controller = SpecController(config.num_speculative_tokens, config.adaptive)
        self.lossy = config.rejection_sample_method != "strict"
        # The most tree nodes one sequence may send (a chain's bound is k). Drafter services
        # (method None) and combined proposers may send trees within the default budget unless
        # the config sets one.
        self.max_tree_nodes = config.tree.max_nodes if config.tree is not None else (
            DEFAULT_TREE_NODES if config.method in (None, "combined") else 0)
        # Counters per drafter (the in-process proposer counts as its method): the verifier
        # exports them as Prometheus counters labelled by drafter.
        self.stats_by_drafter: dict[str, SpecStats] = defaultdict(SpecStats)
        # In-process index drafters asked before each plan, and how much of each sequence's
        # history each has been sent (its own count: the chosen drafter's is seq.spec_sent).
        self._inline_sent: dict[tuple[str | None, int], int] = {}
        self._steps_unasked: dict[str | None, int] = {}  # steps since each inline drafter was last asked
        self.offer_seconds = 0.0  # the last step's asking of the inline drafters (the debug log prints it)
        self.offered_nothing = False  # the last step asked an inline drafter and got no draft from any
        self._offer_sources: dict[int, dict[str | None, str]] = {}  # the last offers' sources (Proposal.source)
        self._reads_history = False  # this step sends a drafter (not an in-process index) a whole history

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden states the proposer wants (specd/proposers/base.py); () for none.
        Read every step: a drafter pool's answer changes as hidden-state drafters come and go."""
        return tuple(getattr(self.proposer, "feature_layers", None) or ())

    # -- propose ---------------------------------------------------------------
    @property
    def mode(self) -> dict:
        """The rejection sampler's knobs (SpecDecodeMetadata's keyword arguments)."""
        c = self.config
        return dict(mode=c.rejection_sample_method, posterior_threshold=c.posterior_threshold,
                    posterior_alpha=c.posterior_alpha, synthetic_acceptance_rate=c.synthetic_acceptance_rate or 0.0)

    def propose(self, batch: list[ScheduledSeq], budget_left: int) -> dict[int, Drafts]:
        """Drafts by seq_id for the decoding entries of the batch (the batch is not changed)."""
        self._reads_history = False
        drafts = self._propose(batch, budget_left)
        # A drafter that reads a sequence's whole history in this step (first contact, a switch, a
        # resync), or still reads one in the background on the cores the verifier computes on, makes
        # this cycle slower than its mode is: a one-off per sequence, which timed, the calibration
        # would carry over the next cycles (at batch 8 on chat, the draft model's first contact with 8
        # new sequences took the speculative calibration from 1.0 to 0.5, then 0.18, where it priced
        # the suffix index's offers out for the rest of the run: 0.94x of plain on code edits after
        # chat, 2-core Xeon without AMX, 2026-11-30).
        if self._reads_history or getattr(self.proposer, "reading_histories", False):
            self.controller.not_timed()
        return drafts

    def _propose(self, batch: list[ScheduledSeq], budget_left: int) -> dict[int, Drafts]:
        decoding = [e for e in batch if e.num_new_tokens == 1 and e.num_logits == 1]
        if not decoding:
            return {}
        # An in-process index may draft past the config's k (its own num_speculative_tokens): its draft
        # is made before the plan, and costs only the rows verified where it is taken.
        limit = max([self.config.num_speculative_tokens, *(getattr(p, "k", 0) for p in self.inline.values())])
        caps = [self._cap(e.seq, budget_left, limit) for e in decoding]
        for e in decoding:
            if e.seq.seq_id not in self.controller.sampled:
                self.controller.note_sampling(e.seq.seq_id, not e.seq.params.greedy)
        base_tokens = sum(e.num_new_tokens for e in batch)
        pinned = {e.seq.seq_id: name for e in decoding if (name := self._pinned(e.seq.seq_id))}
        seqs = [(e.seq.seq_id, cap, self._fixed_k(e.seq)) for e, cap in zip(decoding, caps)]
        if not pinned and self.controller.reuse_plain(seqs, base_tokens) is not None:
            return {}  # plain decoding, as the last plan wanted: no offers asked, no plan made
        t0 = time.perf_counter()
        names = self._drafter_names()
        offers = self._offers(decoding, caps, pinned, names, base_tokens)
        plan = self.controller.plan(seqs, base_tokens, names, pinned,
                                    {sid: {n: len(d) for n, d in by.items()} for sid, by in offers.items()},
                                    self._offer_sources)
        self.controller.planned(time.perf_counter() - t0, base_tokens, nothing_offered=self.offered_nothing)
        if log.isEnabledFor(logging.DEBUG):  # why a step speculates or not (--log-level debug)
            c, first = self.controller, decoding[0].seq.seq_id
            log.debug("step of %d: %s, (k, drafter) %s; seq %d's (alpha, made) by drafter %s; explore credit %s; "
                      "predicted over realized time: plain %.2f, spec %.2f; offers of %s (%.2f ms to ask); "
                      "steps kept plain by the requests' slack so far %d, seq %d's slack %.2f steps; "
                      "%d of %d offer %d tokens; rates (plain raw, calibrated; best spec k, raw, calibrated) %s",
                      len(decoding), c.step_mode, plan[:4], first,
                      {n: tuple(round(x, 2) for x in c.estimates(first, n)) for n in self._drafter_names()},
                      {n: round(v * 1e3, 2) for n, v in c.exploration.credit.items()},
                      c.calibration.scale(len(decoding), "plain"), c.calibration.scale(len(decoding), "spec"),
                      {n: len(d) for n, d in offers.get(first, {}).items()}, self.offer_seconds * 1e3,
                      c.slack_plain_steps, first, c.ledger.headroom(first),
                      sum(any(d for d in by.values()) for by in offers.values()), len(decoding),
                      sum(len(d) for by in offers.values() for d in by.values()),
                      c.rates and tuple(round(x, 1) for x in c.rates))
        requests, entries, out = [], [], {}
        layers = self.feature_layers
        for e, (k, drafter) in zip(decoding, plan):
            if k <= 0:
                continue
            seq = e.seq
            if drafter in self.inline:  # drafted already
                drafts = offers.get(seq.seq_id, {}).get(drafter, [])
                self.controller.observe_proposal(seq.seq_id, drafter, bool(drafts))
                if drafts:
                    source = self._offer_sources.get(seq.seq_id, {}).get(drafter, "")
                    out[seq.seq_id] = Drafts(drafts[:k], None, drafter, offered=len(drafts), source=source)
                continue
            # A drafter new to this sequence reads its whole history first.
            full = seq.spec_sent == 0 or drafter != self.controller.current.get(seq.seq_id, drafter)
            length = len(seq)
            features, features_from = None, 0
            if layers:
                features_from = _features_from(seq, length) if full else 0
                # The state that predicted each new token (position before it); none for token 0.
                features = self._features(seq, layers, features_from if full else seq.spec_sent - 1, length - 1)
                if features is None:
                    continue
            new_tokens = seq.token_slice(0 if full else seq.spec_sent, length)
            requests.append(ProposeRequest(seq_id=seq.seq_id, new_tokens=new_tokens, num_tokens=length, k=k, full_history=full,
                                           num_prompt_tokens=len(seq.prompt_token_ids),
                                           temperature=drafting_temperature(seq.params), seed=seq.params.seed,
                                           features=features, feature_layers=layers, drafter=drafter,
                                           structured_outputs=_structured(seq) if full else None,
                                           features_from=features_from, cache_output=seq.params.cache_output))
            entries.append(e)
            self._reads_history |= full
            seq.spec_sent, seq.spec_features_from = length, None
        if not requests:
            return out
        t0 = time.perf_counter()
        proposals = self.proposer.propose(requests)
        self._observe_proposals(requests, proposals, time.perf_counter() - t0)
        by_id = {p.seq_id: p for p in proposals}
        for e, req in zip(entries, requests):
            p = by_id.get(e.seq.seq_id)
            if p is None or p.resync:
                e.seq.spec_sent = 0  # resend the full history next time
                # its rows from where the head's prefix cache ends, if it said so (else all of them)
                held = p.history_held if p is not None else 0
                e.seq.spec_features_from = held if held < req.features_from else 0
                continue
            drafts, q, parents = self._validated(p, req.k)
            if drafts:
                out[e.seq.seq_id] = Drafts(drafts, q or None, p.drafter or self.config.method, parents, p.cached)
        return out

    def _offers(self, decoding: list[ScheduledSeq], caps: list[int], pinned: dict[int, str],
                names: list[str | None], base_tokens: int) -> dict[int, dict[str | None, list[int]]]:
        """Every in-process index drafter's draft for every decoding sequence that may draft, at its
        cap: {seq_id: {drafter: validated drafts}} (a lookup costs microseconds, so whether a
        sequence has a draft, and how long, is known before the plan). Where no draft of this
        drafter could pay at this batch size (controller.offers_may_pay), only the sequences whose
        request named it or set its own k are asked; the others read as offering nothing."""
        out: dict[int, dict[str | None, list[int]]] = {}
        self._offer_sources = {}
        t0 = time.perf_counter()
        num_asked = num_drafted = 0
        kinds = {not e.seq.params.greedy for e in decoding}
        for name, proposer in self.inline.items():
            if name not in names:
                continue
            # Now and then asked anyway: what it offers, and how much of that is accepted, stays measured
            # (a workload that starts repeating its prompt would otherwise never reopen it).
            unasked = self._steps_unasked.get(name, 0) + 1
            may_pay, priced_out = self.controller.offers_may_pay(name, len(decoding), base_tokens, max(caps), kinds)
            if unasked >= ASK_ANYWAY_EVERY:  # every source, now and then
                may_pay, priced_out = True, frozenset()
            self._steps_unasked[name] = 0 if may_pay and not priced_out else unasked
            requests, asked = [], {}
            for e, cap in zip(decoding, caps):
                seq, sid = e.seq, e.seq.seq_id
                fixed = self._fixed_k(seq)
                if cap <= 0 or fixed == 0 or pinned.get(sid, name) != name:
                    continue
                if not may_pay and fixed is None and sid not in pinned:
                    out.setdefault(sid, {})[name] = []
                    continue
                sent, length = self._inline_sent.get((name, sid), 0), len(seq)
                requests.append(ProposeRequest(
                    seq_id=sid, new_tokens=seq.token_slice(sent, length), num_tokens=length, k=cap,
                    full_history=sent == 0, num_prompt_tokens=len(seq.prompt_token_ids),
                    temperature=drafting_temperature(seq.params), seed=seq.params.seed, drafter=name,
                    cache_output=seq.params.cache_output, skip_sources=priced_out))
                self._inline_sent[name, sid] = length
                asked[sid] = cap
            for p in proposer.propose(requests) if requests else []:
                if p.seq_id not in asked:
                    continue
                if p.resync:
                    self._inline_sent.pop((name, p.seq_id), None)  # the whole history next step
                    continue
                drafts, _, _ = self._validated(replace(p, q_ids=None, q_probs=None), asked[p.seq_id])
                out.setdefault(p.seq_id, {})[name] = drafts
                if drafts and p.source:
                    self._offer_sources.setdefault(p.seq_id, {})[name] = p.source
                num_drafted += bool(drafts)
            num_asked += len(asked)
        self.offered_nothing = num_asked > 0 and num_drafted == 0
        self.offer_seconds = time.perf_counter() - t0
        return out

    @property
    def inline(self) -> dict:
        """The in-process index drafters by name: a pool's local ones, else the one proposer if it is one."""
        local = getattr(self.proposer, "inline_drafters", None)
        if local is not None:
            return local
        return {self.config.method: self.proposer} if offers_chains_inline(self.proposer) else {}

    def _drafter_names(self) -> list[str | None]:
        """The drafters the controller chooses among: a pool's healthy ones, else the one proposer."""
        names = getattr(self.proposer, "drafter_names", None)
        return list(names) if names else [self.config.method]

    def _pinned(self, seq_id: int) -> str | None:
        """The drafter a request named for itself (a pool routes it there whatever we choose)."""
        pinned = getattr(self.proposer, "pinned_drafter", None)
        return pinned(seq_id) if pinned is not None else None

    def _observe_proposals(self, requests, proposals, seconds: float) -> None:
        """Which drafter answered each sequence and whether it drafted; the call's time per drafter.
        Drafters of one call answer concurrently: each is charged the whole call (an upper bound).
        An answer without drafts (a suffix index without a match) costs its round trip and is
        timed; a drafter that did not answer (past its deadline, down, out of sync: resync) or
        took the history in the background (deferred: it is catching up) says nothing about its
        cost: timed, one 250 ms deadline would price drafting out for long after the drafter
        recovered."""
        asked = {r.seq_id: r.k for r in requests}
        by_drafter: dict[str | None, list] = defaultdict(list)
        for p in proposals:
            if p.resync or p.seq_id not in asked:
                continue
            name = p.drafter or self.config.method
            if p.deferred:  # it holds the history now: the next ask sends only what comes after
                self.controller.current[p.seq_id] = name
                continue
            drafted = _depth(p.parents) if p.token_ids and p.parents else len(p.token_ids)
            self.controller.observe_proposal(p.seq_id, name, bool(p.token_ids), drafted, asked[p.seq_id])
            by_drafter[name].append(p)
        for name, ps in by_drafter.items():
            one = self._one_forward(name)
            self.controller.observe_draft(1 if one else max(asked[p.seq_id] for p in ps), len(ps), seconds,
                                          sum(p.cached for p in ps) / len(ps), name, one_forward=one)

    def _one_forward(self, name: str | None) -> bool:
        """Whether the drafter drafts all k in one forward (a pool asks the drafter's Info)."""
        of = getattr(self.proposer, "one_forward_of", None)
        return of(name) if of is not None and name is not None else bool(getattr(self.proposer, "one_forward", False))

    @staticmethod
    def _features(seq: Sequence, layers: tuple[int, ...], start: int, end: int):
        """Feature rows [start, end) of seq, or None where they were not captured for these
        layers (it was prefilled before such a drafter came): it decodes without drafts."""
        if seq.features is None or seq.features.layers != layers or seq.features.num_rows < end:
            return None
        return seq.features.rows(start, end)

    def _fixed_k(self, seq: Sequence) -> int | None:
        """The request's own k, if any; in a lossy mode a seeded sampled request drafts at full k
        (batch-independent: _own_stream)."""
        if seq.params.num_speculative_tokens is not None:
            return seq.params.num_speculative_tokens
        return self.config.num_speculative_tokens if self._own_stream(seq) else None

    def _own_stream(self, seq: Sequence) -> bool:
        """A seeded request that samples in a lossy mode: it draws from its own generator, and its k
        decides how much of it a step consumes, so it drafts at a k of its own, not the batch's. In
        strict mode a seeded request's token at each position is drawn by that position alone
        (sampler.position_walk), and a greedy one's is the argmax, whatever k: their k is the
        controller's (pinned to the full k, seeded greedy chat at batch 8 decoded at 0.66x of plain,
        seeded T 0.7 chat 0.59-0.65x; 2-core Xeon without AMX, suffix index k 8, 2026-11-29)."""
        return (seq.params.seed is not None and not seq.params.greedy
                and self.config.rejection_sample_method != "strict")

    def _cap(self, seq: Sequence, budget_left: int, limit: int) -> int:
        # Never draft past max_tokens or max_model_len: k drafts can commit k + 1 tokens.
        room_tokens = seq.params.max_tokens - len(seq.output_token_ids) - 1
        room_context = self.max_model_len - len(seq) - 1
        cap = min(limit, room_tokens, room_context)
        # A k that must not depend on the batch (_own_stream): the shared token budget skips it.
        if not self._own_stream(seq):
            cap = min(cap, budget_left)
        return max(0, cap)

    def _validated(self, p, k: int):
        """Drafts cut at the first bad entry: a proposer never corrupts output, it only costs drafts.
        A tree (p.parents) keeps its first nodes up to max_tree_nodes while each has a parent
        before it and a depth of at most k (k + 1 tokens may commit); a prefix of a tree whose
        parents point backwards is a tree. -> (drafts, q, parents or None for a chain)."""
        parents = p.parents
        if parents is not None and (not self.max_tree_nodes or self.lossy):
            return [], None, None  # this engine verifies chains only (lossy acceptance: chains only)
        drafts, depth = [], []
        limit = k if parents is None else min(self.max_tree_nodes, len(parents))
        for i, t in enumerate(p.token_ids[:limit]):
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                break
            if parents is not None:
                par = parents[i]
                if not isinstance(par, int) or not -1 <= par < i:
                    break
                d = 1 if par < 0 else depth[par] + 1
                if d > k:
                    break
                depth.append(d)
            drafts.append(t)
        q = None
        if p.q_ids:  # sampled drafts: the sparse q must be a distribution that contains the draft
            ok = p.q_probs is not None and len(p.q_ids) >= len(drafts) and len(p.q_probs) >= len(drafts)
            q = list(zip(p.q_ids, p.q_probs or []))[: len(drafts)] if ok else []
            if not ok or not all(self._valid_q(t, ids, probs) for t, (ids, probs) in zip(drafts, q)):
                return [], None, None
        return drafts, q, None if parents is None else list(parents[: len(drafts)])

    def _valid_q(self, draft: int, ids: list[int], probs: list[float]) -> bool:
        if not ids or len(ids) != len(probs) or len(set(ids)) != len(ids):
            return False
        if not all(0 <= i < self.vocab_size for i in ids) or not all(math.isfinite(x) and x >= 0 for x in probs):
            return False
        return abs(sum(probs) - 1.0) < 1e-3 and probs[ids.index(draft)] > 0 if draft in ids else False

    # -- after the step ----------------------------------------------------------
    def observe(self, batch: list[ScheduledSeq], num_accepted: list[int]) -> None:
        """num_accepted[i]: accepted drafts of the i-th entry with logits."""
        for e, n_acc in zip((e for e in batch if e.num_logits), num_accepted):
            n = len(e.draft_token_ids)
            # The controller models a chain of k: a tree counts as a chain of its depth.
            self.controller.observe_accept(e.seq.seq_id, _depth(e.drafts.parents) if n and e.drafts.parents else n,
                                           n_acc, e.drafts.drafter if n else None, e.drafts.offered if n else 0,
                                           e.drafts.source if n else "")
            cached = bool(n and e.drafts.cached)
            drafter = (e.drafts.drafter or self.config.method or "unknown") if n else None
            e.seq.spec_stats.observe_draft(n, n_acc, cached, drafter)
            if n:
                self.stats_by_drafter[drafter].observe_draft(n, n_acc, cached)

    def end_step(self, batch: list[ScheduledSeq], start: float, compute_s: float,
                 finished: bool) -> None:
        """A step where every sequence decoded (no prefill chunk) and none finished is a cycle the
        controller calibrates speculative and plain decoding on."""
        if not finished and batch and all(e.num_logits == e.num_new_tokens for e in batch):
            self.controller.open_cycle(len(batch), start, compute_s)

    def release(self, seq: Sequence) -> None:
        self.controller.release(seq.seq_id)
        for name, proposer in self.inline.items():
            if self._inline_sent.pop((name, seq.seq_id), None) is not None:
                proposer.release([seq.seq_id])
        if seq.spec_sent:
            self.proposer.release([seq.seq_id])


def offers_chains_inline(proposer) -> bool:
    """Whether a proposer can be asked before each plan: an index that answers in microseconds
    (answers_inline) and drafts chains (an n-gram index set to draft trees does not: the plan prices
    an offered draft by its length)."""
    return getattr(proposer, "answers_inline", False) and getattr(proposer, "tree_branches", 1) <= 1


def _depth(parents: list[int]) -> int:
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


def _features_from(seq: Sequence, length: int) -> int:
    """Where a full history's feature rows start (ProposeRequest.features_from). After a resync,
    where the head said its prefix cache ends; else where this request's prefix hit in the
    verifier's cache ends, as the head can hold it: a head keeps 16-pair blocks, pair p reads
    token p + 1, so of c tokens shared with an earlier history it holds 16 * ((c - 1) // 16)
    pairs. One pair at least is always sent (the head's output at the last pair)."""
    if seq.spec_features_from is not None:
        start = seq.spec_features_from
    else:
        start = 16 * ((seq.num_cached_tokens - 1) // 16) if seq.num_cached_tokens else 0
    return max(0, min(start, length - 2))


def _structured(seq) -> str | None:
    """A constrained request's grammar as JSON, for drafters that mask their own drafts."""
    so = seq.params.structured_outputs
    return json.dumps(so.to_dict()) if so is not None else None
