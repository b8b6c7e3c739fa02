"""The in-process index drafters' offers: their drafts asked for before each plan.

An index drafter (suffix, ngram: answers_inline) looks a draft up in microseconds, so the
speculator (speculator.py) asks it first, every step, for every decoding sequence at its cap, and
the controller plans knowing whether a sequence has a draft, and how long, rather than guessing.
Where none of a drafter's drafts could pay at the step's batch size (the controller's
offers_may_pay) it is left unasked, but for the requests that named it or set their own k.
"""
from __future__ import annotations

import time
from dataclasses import replace

from specd.engine.spec.proposal import ProposeRequest, drafting_temperature

# Where none of an in-process index's drafts could pay (a CPU at batch 32), it is still asked every
# this many steps: the plan may take or explore what it offers, so its acceptance keeps being measured.
ASK_ANYWAY_EVERY = 16


def offers_chains_inline(proposer) -> bool:
    """Whether a proposer can be asked before each plan: an index that answers in microseconds
    (answers_inline) and drafts chains (an n-gram index set to draft trees does not: the plan prices
    an offered draft by its length)."""
    return getattr(proposer, "answers_inline", False) and getattr(proposer, "tree_branches", 1) <= 1


class InlineOffers:
    def __init__(self, proposer, method: str | None, controller, validator):
        self.proposer, self.method = proposer, method  # the speculator's proposer and its config's method
        self.controller, self.validator = controller, validator
        # How much of each sequence's history each drafter has been sent (its own count: the chosen
        # drafter's is seq.spec_sent).
        self.sent: dict[tuple[str | None, int], int] = {}
        self._steps_unasked: dict[str | None, int] = {}  # steps since each drafter was last asked
        self.seconds = 0.0  # the last step's asking (the debug log prints it)
        self.nothing = False  # the last step asked a drafter and got no draft from any
        self.sources: dict[int, dict[str | None, str]] = {}  # the last offers' sources (Proposal.source)

    @property
    def drafters(self) -> dict:
        """The in-process index drafters by name: a pool's local ones, else the one proposer if it is one."""
        local = getattr(self.proposer, "inline_drafters", None)
        if local is not None:
            return local
        return {self.method: self.proposer} if offers_chains_inline(self.proposer) else {}

    def ask(self, decoding: list, caps: list[int], pinned: dict[int, str], names: list[str | None],
            base_tokens: int, fixed: list[int | None]) -> dict[int, dict[str | None, list[int]]]:
        """Every drafter's draft for every decoding sequence that may draft, at its cap (fixed: each
        request's own k, if any): {seq_id: {drafter: validated drafts}}. Where no draft of this
        drafter could pay at this batch size (controller.offers_may_pay), only the sequences whose
        request named it or set its own k are asked; the others read as offering nothing."""
        out: dict[int, dict[str | None, list[int]]] = {}
        self.sources = {}
        t0 = time.perf_counter()
        num_asked = num_drafted = 0
        kinds = {not e.seq.params.greedy for e in decoding}
        for name, proposer in self.drafters.items():
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
            for e, cap, own_k in zip(decoding, caps, fixed):
                seq, sid = e.seq, e.seq.seq_id
                if cap <= 0 or own_k == 0 or pinned.get(sid, name) != name:
                    continue
                if not may_pay and own_k is None and sid not in pinned:
                    out.setdefault(sid, {})[name] = []
                    continue
                sent, length = self.sent.get((name, sid), 0), len(seq)
                requests.append(ProposeRequest(
                    seq_id=sid, new_tokens=seq.token_slice(sent, length), num_tokens=length, k=cap,
                    full_history=sent == 0, num_prompt_tokens=len(seq.prompt_token_ids),
                    temperature=drafting_temperature(seq.params), seed=seq.params.seed, drafter=name,
                    cache_output=seq.params.cache_output, skip_sources=priced_out))
                self.sent[name, sid] = length
                asked[sid] = cap
            for p in proposer.propose(requests) if requests else []:
                if p.seq_id not in asked:
                    continue
                if p.resync:
                    self.sent.pop((name, p.seq_id), None)  # the whole history next step
                    continue
                drafts, _, _ = self.validator.validated(replace(p, q_ids=None, q_probs=None), asked[p.seq_id])
                out.setdefault(p.seq_id, {})[name] = drafts
                if drafts and p.source:
                    self.sources.setdefault(p.seq_id, {})[name] = p.source
                num_drafted += bool(drafts)
            num_asked += len(asked)
        self.nothing = num_asked > 0 and num_drafted == 0
        self.seconds = time.perf_counter() - t0
        return out

    def release(self, seq_id: int) -> None:
        for name, proposer in self.drafters.items():
            if self.sent.pop((name, seq_id), None) is not None:
                proposer.release([seq_id])
