"""What the speculation controller knows of its drafters (specd/engine/spec/controller.py decides
with it): acceptance per sequence and per drafter, by draft position and by the length a drafter
offered, what a drafter's drafts cost, and the expected tokens of a draft.

  acceptance   α (geometric MLE: accepted / (accepted + rejections)), forgetting old steps, with
               two pseudo-trials of a prior so a short history does not swing to 0 or 1
  positions    c_j, the j-th draft accepted where the j - 1 before it were, and l_j, a j-th token
               drafted where j - 1 were and k allowed j: a suffix index's drafts are accepted
               ~0.8 per token past the first against ~0.55 for the first, and it stops drafting
               where its match ends
  drafters     cost D(n) per draft step, pipelining's hit share h and wait W, acceptance apart
               for greedy and sampled sequences, and the share y of proposals that held drafts
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specd.engine.spec.costs import DraftCost

PRIOR_ALPHA = 0.6  # acceptance assumed for a sequence before it has any history


def expected_tokens(alpha: float, k: int) -> float:
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class Acceptance:
    accepted: float = 0.0
    trials: float = 0.0

    def alpha(self, prior: float) -> float:
        # Two pseudo-trials of the prior keep a short history from swinging to 0 or 1.
        return (self.accepted + 2 * prior) / (self.trials + 2)

    def observe(self, accepted: float, trials: float) -> None:
        self.accepted = 0.95 * self.accepted + accepted
        self.trials = 0.95 * self.trials + trials


@dataclass
class Positions:
    """A drafter's drafts position by position (1-based j, index j - 1): accepted[j], the j-th
    token accepted where the j - 1 before it were; drafted[j], a j-th token drafted where j - 1
    were and k allowed j. With none measured: α for acceptance, every token drafted."""

    accepted: list[Acceptance] = field(default_factory=list)
    drafted: list[Acceptance] = field(default_factory=list)

    @staticmethod
    def _at(rows: list[Acceptance], j: int) -> Acceptance:
        while len(rows) < j:
            rows.append(Acceptance())
        return rows[j - 1]

    def observe_accept(self, num_draft: int, num_accepted: int) -> None:
        for j in range(1, min(num_accepted + 1, num_draft) + 1):
            self._at(self.accepted, j).observe(float(j <= num_accepted), 1.0)

    def observe_drafted(self, drafted: int, asked: int) -> None:
        for j in range(2, min(drafted + 1, asked) + 1):
            self._at(self.drafted, j).observe(float(j <= drafted), 1.0)

    def chain(self, n: int, alpha: float, under: "Positions") -> list[float]:
        """Accepted tokens expected of a known n-token draft cut at k, for k = 0..n: the positions
        measured here, past them the drafter's over all lengths (under), past those alpha."""
        out, accepted, p_accepted = [0.0], 0.0, 1.0
        for j in range(1, n + 1):
            prior = under.accepted[min(j, len(under.accepted)) - 1].alpha(alpha) if under.accepted else alpha
            p_accepted *= self.accepted[j - 1].alpha(prior) if j <= len(self.accepted) else prior
            accepted += p_accepted
            out.append(accepted)
        return out

    def curve(self, max_k: int, alpha: float) -> list[tuple[float, float]]:
        """(accepted tokens, tokens drafted) expected of a draft capped at k, for k = 0..max_k."""
        out = [(0.0, 0.0)]
        accepted = rows = 0.0
        p_drafted = p_accepted = 1.0
        for j in range(1, max_k + 1):
            # Past the deepest position measured, a draft goes on as it did there (a k never asked
            # for is priced from the nearest one that was, and is tried and measured once it pays).
            drafted = self.drafted[min(j, len(self.drafted)) - 1].alpha(1.0) if j > 1 and self.drafted else 1.0
            accept = self.accepted[min(j, len(self.accepted)) - 1].alpha(alpha) if self.accepted else alpha
            p_drafted *= drafted
            p_accepted *= drafted * accept
            rows += p_drafted
            accepted += p_accepted
            out.append((accepted, rows))
        return out


@dataclass
class DrafterStats:
    """What the controller knows of one drafter: its cost, and its acceptance over all sequences,
    apart for greedy (key False) and sampled (key True) sequences."""

    cost: DraftCost = field(default_factory=DraftCost)  # s per draft step vs seqs
    hit_rate: float = 0.0  # pipelined drafters: share of proposals from the draft cache (EWMA)
    hit_wait: float = 0.0  # seconds a propose call waits when its proposals were drafted ahead (EWMA)
    acceptance: dict[bool, Acceptance] = field(default_factory=lambda: {False: Acceptance(), True: Acceptance()})
    made: Acceptance = field(default_factory=Acceptance)  # proposals with drafts / proposals
    positions: dict[bool, Positions] = field(default_factory=lambda: {False: Positions(), True: Positions()})
    # Drafts offered before the plan (an in-process index asked every step): positions by the
    # length offered, per kind. A suffix index's 1-token drafts (a 1-token match) were accepted
    # 0.19 per token on chat, its 8-token ones 0.74 (12 chat prompts, k 8, EPYC family 25). Keyed
    # (source, length): where the index says which of its sources drafted (Proposal.source: the
    # request's own history, the answer cache, a datastore), each keeps its own positions.
    by_length: dict[bool, dict[tuple[str, int], Positions]] = field(default_factory=lambda: {False: {}, True: {}})

    one_forward: bool = False  # all k drafts from one forward (parallel drafting): a call costs one step

    def seconds(self, num_seqs: int, k: int) -> float:
        """Expected wait for drafts: k draft steps over num_seqs sequences, less what was drafted ahead."""
        if k <= 0:
            return 0.0
        steps = 1 if self.one_forward else k
        return (1 - self.hit_rate) * self.cost(num_seqs) * steps + self.hit_rate * self.hit_wait


@dataclass
class SeqDrafterStats:
    acceptance: Acceptance = field(default_factory=Acceptance)
    made: Acceptance = field(default_factory=Acceptance)
    tries: int = 0  # proposals asked of this drafter for this sequence
