"""The speculative part of an engine step: drafts before the forward, counters after.

propose: in-process index drafters (suffix, ngram: a lookup of microseconds, answers_inline)
  are asked first, every step, for every decoding sequence at its full k (offers.py); the
  controller then picks k and the drafter per sequence knowing what they offered, the other
  proposers (the same objects the drafter service hosts, or a verifier's pool of drafter
  services) draft for the sequences it sent to them, and the validated drafts (validation.py)
  go back to the engine as Drafts per sequence; the scheduler attaches them to the batch
  ([last token, d1 .. dk], all with logits). Verification is the sampler's (specd.engine.sampler).
observe: acceptance per sequence feeds the controller and the per-drafter counters.
"""
from __future__ import annotations

import json
import logging
import time
from collections import defaultdict

from specd.config import DEFAULT_TREE_NODES, SpeculativeConfig
from specd.engine.scheduler import Drafts, ScheduledSeq
from specd.engine.sequence import Sequence
from specd.engine.spec.controller import SpecController
from specd.engine.spec.offers import InlineOffers
from specd.engine.spec.proposal import ProposeRequest, drafting_temperature
from specd.engine.spec.validation import DraftValidator
from specd.engine.spec_stats import SpecStats

log = logging.getLogger("specd.speculation")


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, vocab_size: int, max_model_len: int):
        self.config, self.proposer = config, proposer
        self.max_model_len = max_model_len
        self.controller = SpecController(config.num_speculative_tokens, config.adaptive)
        self.lossy = config.rejection_sample_method != "strict"
        # The most tree nodes one sequence may send (a chain's bound is k). Drafter services
        # (method None) and combined proposers may send trees within the default budget unless
        # the config sets one.
        max_tree_nodes = config.tree.max_nodes if config.tree is not None else (
            DEFAULT_TREE_NODES if config.method in (None, "combined") else 0)
        self.validator = DraftValidator(vocab_size, max_tree_nodes, self.lossy)
        # The in-process index drafters, asked before each plan (offers.py).
        self.offers = InlineOffers(proposer, config.method, self.controller, self.validator)
        # Counters per drafter (the in-process proposer counts as its method): the verifier
        # exports them as Prometheus counters labelled by drafter.
        self.stats_by_drafter: dict[str, SpecStats] = defaultdict(SpecStats)
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
        limit = max([self.config.num_speculative_tokens,
                     *(getattr(p, "k", 0) for p in self.offers.drafters.values())])
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
        offers = self.offers.ask(decoding, caps, pinned, names, base_tokens, [own_k for _, _, own_k in seqs])
        plan = self.controller.plan(seqs, base_tokens, names, pinned,
                                    {sid: {n: len(d) for n, d in by.items()} for sid, by in offers.items()},
                                    self.offers.sources)
        self.controller.planned(time.perf_counter() - t0, base_tokens, nothing_offered=self.offers.nothing)
        if log.isEnabledFor(logging.DEBUG):  # why a step speculates or not (--log-level debug)
            self._log_plan(decoding, plan, offers)
        return self._planned_drafts(decoding, plan, offers)

    def _log_plan(self, decoding: list[ScheduledSeq], plan: list, offers: dict) -> None:
        c, first = self.controller, decoding[0].seq.seq_id
        log.debug("step of %d: %s, (k, drafter) %s; seq %d's (alpha, made) by drafter %s; explore credit %s; "
                  "predicted over realized time: plain %.2f, spec %.2f; offers of %s (%.2f ms to ask); "
                  "steps kept plain by the requests' slack so far %d, seq %d's slack %.2f steps; "
                  "%d of %d offer %d tokens; rates (plain raw, calibrated; best spec k, raw, calibrated) %s",
                  len(decoding), c.step_mode, plan[:4], first,
                  {n: tuple(round(x, 2) for x in c.estimates(first, n)) for n in self._drafter_names()},
                  {n: round(v * 1e3, 2) for n, v in c.exploration.credit.items()},
                  c.calibration.scale(len(decoding), "plain"), c.calibration.scale(len(decoding), "spec"),
                  {n: len(d) for n, d in offers.get(first, {}).items()}, self.offers.seconds * 1e3,
                  c.slack_plain_steps, first, c.ledger.headroom(first),
                  sum(any(d for d in by.values()) for by in offers.values()), len(decoding),
                  sum(len(d) for by in offers.values() for d in by.values()),
                  c.rates and tuple(round(x, 1) for x in c.rates))

    def _planned_drafts(self, decoding: list[ScheduledSeq], plan: list, offers: dict) -> dict[int, Drafts]:
        """The plan's drafts: those offered already, and the other drafters' asked for now."""
        requests, entries, out = [], [], {}
        layers = self.feature_layers
        for e, (k, drafter) in zip(decoding, plan):
            if k <= 0:
                continue
            seq = e.seq
            if drafter in self.offers.drafters:  # drafted already
                drafts = offers.get(seq.seq_id, {}).get(drafter, [])
                self.controller.observe_proposal(seq.seq_id, drafter, bool(drafts))
                if drafts:
                    source = self.offers.sources.get(seq.seq_id, {}).get(drafter, "")
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
            drafts, q, parents = self.validator.validated(p, req.k)
            if drafts:
                out[e.seq.seq_id] = Drafts(drafts, q or None, p.drafter or self.config.method, parents, p.cached)
        return out

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
        self.offers.release(seq.seq_id)
        if seq.spec_sent:
            self.proposer.release([seq.seq_id])


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
