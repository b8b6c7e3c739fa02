"""draft_model proposer: a small model on our own engine, batched across sequences.

Each tracked sequence keeps its committed history and the KV for it in the drafter's
own paged cache. A propose call runs k batched forwards: the first catches up on the
newly committed tokens and yields draft 1, each next one feeds the previous draft.
Afterwards the KV of the drafts is rolled back, so state only ever holds committed
tokens (the accepted drafts are recomputed as part of the next catch-up chunk, which
costs no extra forward).

Greedy drafts ship only ids (q is one-hot). Sampled drafts come from the drafter's
top-k truncated, renormalised distribution at the request's temperature, and that
sparse q ships with them so the verifier can accept exactly (draft_sampling.py).

Token trees (tree_branching [b1, b2, ..]): one forward per depth, as for a chain. The
catch-up forward gives the root's b1 children (its top-b1 tokens, or b1 draws without
replacement); each next forward runs the newest nodes with a tree attention mask (each sees
the committed context and its ancestors, specd/engine/model/attention.py) and gives each of them
b_d children. Nodes are in breadth-first order, at most tree_max_nodes.

Parallel drafting (PARD, Chen et al. 2025; a draft model whose config has `pard_token`, as vLLM
reads it): one forward drafts the whole chain. The drafter runs the catch-up chunk followed by
k - 1 copies of the mask token; the last committed token's row gives draft 1 and the j-th mask's
row draft j + 1, each from the committed context alone (a valid proposal: the verifier's
acceptance only needs the q each draft was drawn from). The masks' KV is rolled back like drafts.
A k-token draft then costs one small forward instead of k.

Dynamic trees (tree_dynamic, greedy drafts; EAGLE-2's idea): the shape follows the drafter's
confidence. A node's score is its path probability (the product of the drafter's probabilities
from the root). At depth d the b_d best-scored nodes of the newest depth are run, each giving its
top b_d tokens as children; the tree_max_nodes best-scored nodes of all are proposed. A child never
outscores its parent, so that set holds every proposed node's ancestors.
"""
from __future__ import annotations

import json
from itertools import accumulate

import torch

from specd.proposers.base import Proposal, ProposeRequest
from specd.proposers.draft_grammar import DraftGrammars
from specd.proposers.draft_sampling import SampledDrafts
from specd.proposers.pipeline import record_alternatives
from specd.engine import kv_memory
from specd.engine.block_manager import BlockManager
from specd.engine.loader import default_device, load_checkpoint, open_checkpoint
from specd.engine.model_runner import ModelRunner
from specd.engine.scheduler import ScheduledSeq
from specd.engine.sequence import Sequence
from specd.sampling import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


DRAFT_SEQUENCES = 64  # full-length sequences a draft model's cache is sized for, memory allowing


class DraftModelProposer(SampledDrafts):
    def __init__(self, model: str, *, dtype: str = "auto", device: str | torch.device = "auto",
                 max_model_len: int | None = None, block_size: int = 16, num_blocks: int | None = None,
                 sample_method: str = "greedy", top_k: int = 16, seed: int | None = None,
                 batch_invariant: bool = True, tree_branching: list[int] | None = None,
                 tree_max_nodes: int = 32, tree_dynamic: bool = False, mask_structured: bool = True):
        self.device = device if isinstance(device, torch.device) else default_device(device)
        ckpt = open_checkpoint(model, dtype, self.device)  # a GGUF drafter serves in its own types
        self.arch, self.dtype = ckpt.arch, ckpt.dtype
        self.max_model_len = min(max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        # Batch-invariant like the target, so a greedy draft does not depend on the drafter's batch.
        self.model = load_checkpoint(ckpt, self.device, self.max_model_len, batch_invariant)
        num_blocks = num_blocks or self._default_num_blocks(block_size)
        if self.device.type == "cpu":
            kv_memory.check_fits(num_blocks * ModelRunner.kv_bytes_per_block(self.model, block_size, self.dtype),
                                 "free memory, or run the drafter on another machine")
        # Its own prefix cache: a new sequence whose prompt starts like an earlier one's (a shared
        # system prompt, a conversation's next turn) computes only the rest of its history.
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=True,
                                   salt=self.model.fingerprint.encode())
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.device, self.dtype)
        self._init_sampling(sample_method, top_k, seed)
        self.tree_branching, self.tree_max_nodes = (list(tree_branching) if tree_branching else None), tree_max_nodes
        self.tree_dynamic = bool(tree_branching) and tree_dynamic
        self.seqs: dict[int, Sequence] = {}
        # chains mask their drafts with a constrained request's grammar (trees draft unmasked)
        self.grammar = DraftGrammars(ckpt.dir, self.arch.vocab_size, self.arch.eos_token_ids,
                                     enabled=mask_structured and not self.tree_branching)
        self.pard_token, self.max_parallel = _parallel_drafting(ckpt.dir)
        self.one_forward = self.pard_token is not None and not self.tree_branching  # a call's cost is flat in k

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def supports_tentative(self) -> bool:
        return not self.tree_branching  # pipelined drafting plans outcomes of chains

    # Tentative requests fork the sequence (_fork): many outcomes of one sequence draft in one batch.
    tentative_batches = True

    def propose(self, batch: list[ProposeRequest]) -> list[Proposal]:
        out: dict[int, Proposal] = {}
        active: list[tuple[Sequence, ProposeRequest]] = []
        keys, forks = [], {}  # keys: where each request's proposal is in out; forks: id -> shared tokens
        for req in batch:
            seq = self._fork(req, -1 - len(forks), forks) if req.tentative else self._sync(req)
            keys.append(seq.seq_id if seq is not None else req.seq_id)
            if seq is None:
                out[keys[-1]] = Proposal(seq_id=req.seq_id, token_ids=[], resync=not req.tentative)
            elif req.k <= 0 or len(seq) + req.k > self.max_model_len:
                out[keys[-1]] = Proposal(seq_id=req.seq_id, token_ids=[])
            else:
                active.append((seq, req))
                out[keys[-1]] = Proposal(seq_id=req.seq_id, token_ids=[],
                                         q_ids=[] if self._sampled(req) else None,
                                         q_probs=[] if self._sampled(req) else None,
                                         parents=[] if self.tree_branching else None,
                                         draft_probs=[] if req.alternatives else None,
                                         alternatives=[] if req.alternatives else None)
        outputs = {seq.seq_id: len(seq.output_token_ids) for seq, _ in active}
        with torch.inference_mode():
            draft = self._draft_dynamic_tree if self.tree_dynamic else \
                self._draft_tree if self.tree_branching else \
                self._draft_parallel if self.pard_token is not None else self._draft
            draft(active, out)
        self.grammar.end_call()
        for seq, _ in active:  # roll back: state holds committed tokens only
            del seq.output_token_ids[outputs[seq.seq_id]:]
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq))
            # a fork gives back its own blocks, never the shared ones
            self.blocks.truncate(seq, forks.get(seq.seq_id, seq.num_computed_tokens))
            if seq.seq_id not in forks:
                self.blocks.commit(seq)
        return [out[key] for key in keys]

    def _fork(self, req: ProposeRequest, fork_id: int, forks: dict[int, int]) -> Sequence | None:
        """A tentative request's sequence: the committed history plus req's delta, reading the
        parent's full KV blocks in place (shared, never written: the fork starts computing at
        the first position after them). Several forks of one sequence draft in one batch."""
        parent = self.seqs.get(req.seq_id)
        if (parent is None or req.full_history or len(parent) + len(req.new_tokens) != req.num_tokens
                or self.tree_branching):
            return None
        fork = Sequence(parent.token_ids + list(req.new_tokens), _GREEDY, seq_id=fork_id)
        shared = min(parent.num_computed_tokens // self.blocks.block_size, len(parent.block_table))
        fork.block_table = parent.block_table[:shared]
        fork.num_computed_tokens = forks[fork_id] = shared * self.blocks.block_size
        return fork

    def _draft(self, active, out) -> None:
        for step in range(max((r.k for _, r in active), default=0)):
            live = [(s, r) for s, r in active if r.k > step and not self.grammar.stopped(s.seq_id) and self._room(s)]
            if not live:
                return
            entries = [ScheduledSeq(s, s.num_uncomputed_tokens, 1) for s, _ in live]
            logits = self.runner.run(entries)
            for e in entries:
                e.seq.num_computed_tokens += e.num_new_tokens
            logits = self.grammar.mask([s.seq_id for s, _ in live], logits)
            for (seq, req), row in zip(live, logits):
                token = self._take(out[seq.seq_id], seq.seq_id, row, req, len(seq))
                seq.output_token_ids.append(token)  # fed as input of the next draft step

    def _draft_parallel(self, active, out) -> None:
        """One forward for every chain: [catch-up chunk, k - 1 masks], k rows of logits each."""
        live, entries, committed = [], [], {}
        for seq, req in active:
            k = min(req.k, self.max_parallel)
            committed[seq.seq_id] = len(seq)
            seq.output_token_ids.extend([self.pard_token] * (k - 1))
            if not self._room(seq):
                del seq.output_token_ids[len(seq.output_token_ids) - (k - 1):]
                continue
            live.append((seq, req, k))
            entries.append(ScheduledSeq(seq, len(seq) - seq.num_computed_tokens, k))
        if not entries:
            return
        logits = self.runner.run(entries)
        for e in entries:
            e.seq.num_computed_tokens += e.num_new_tokens
        first = [0, *accumulate(k for *_, k in live)]  # each chain's first row
        for j in range(max(k for *_, k in live)):
            # Draft j of every chain still going, masked by its grammar after drafts 1..j-1.
            chains = [(i, s, r) for i, (s, r, k) in enumerate(live) if k > j and not self.grammar.stopped(s.seq_id)]
            if not chains:
                return
            rows = self.grammar.mask([s.seq_id for _, s, _ in chains],
                                     logits[torch.tensor([first[i] + j for i, _, _ in chains])])
            for (_, seq, req), row in zip(chains, rows):
                self._take(out[seq.seq_id], seq.seq_id, row, req, committed[seq.seq_id] + j)

    def _take(self, prop: Proposal, seq_id: int, row: torch.Tensor, req: ProposeRequest, length: int) -> int:
        """The next draft of a chain from its (grammar-masked) logits row: the argmax, or a draw
        with its sparse q; appended to the proposal and pushed to the sequence's grammar."""
        if self._sampled(req):
            token, ids, probs = self._sample_sparse(row, req, length)
            prop.q_ids.append(ids)
            prop.q_probs.append(probs)
        else:
            token = int(row.argmax())
        prop.token_ids.append(token)
        if req.alternatives:
            record_alternatives(prop, row, token, req)
        self.grammar.push(seq_id, token)
        return token

    def _draft_tree(self, active, out) -> None:
        # Per sequence: the committed length (the tree's base) and the nodes of the newest depth.
        base = {s.seq_id: len(s) for s, _ in active}
        frontier = {s.seq_id: [-1] for s, _ in active}  # -1: the root (the catch-up's last row)
        # one stream per sequence and step, drawn in the tree's own order: batch-independent
        gens = {s.seq_id: self._draft_generator(r, len(s)) for s, r in active if self._sampled(r)}
        parents = {s.seq_id: out[s.seq_id].parents for s, _ in active}  # grown in place below
        for _, width, live, logits in self._tree_depths(active, base, frontier, parents):
            row = 0
            for seq, req in live:
                prop, newest = out[seq.seq_id], []
                for parent in frontier[seq.seq_id]:
                    room = self.tree_max_nodes - len(prop.token_ids)
                    for token, q in self._children(logits[row], min(width, room), req, gens.get(seq.seq_id)):
                        newest.append(len(prop.token_ids))
                        prop.token_ids.append(token)
                        prop.parents.append(parent)
                        if q is not None:
                            prop.q_ids.append(q[0])
                            prop.q_probs.append(q[1])
                        seq.output_token_ids.append(token)  # fed as input of the next depth
                    row += 1
                frontier[seq.seq_id] = newest

    def _draft_dynamic_tree(self, active, out) -> None:
        base = {s.seq_id: len(s) for s, _ in active}
        # Per sequence: every node as (score, depth, token, parent), the nodes run so far (their
        # order in the drafter's sequence from base on) and the parents of those, in that order.
        nodes = {s.seq_id: [] for s, _ in active}
        run_of = {s.seq_id: {-1: -1} for s, _ in active}  # node -> its place among the run nodes
        run_parents = {s.seq_id: [] for s, _ in active}
        frontier = {s.seq_id: [-1] for s, _ in active}  # nodes to run at this depth; -1: the root
        for depth, width, live, logits in self._tree_depths(active, base, frontier, run_parents):
            row = 0
            for seq, _ in live:
                tree, newest = nodes[seq.seq_id], []
                for parent in frontier[seq.seq_id]:
                    top = logits[row].float().log_softmax(-1).topk(min(width, logits.shape[-1]))
                    score = tree[parent][0] if parent >= 0 else 0.0
                    for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                        newest.append(len(tree))
                        tree.append((score + lp, depth, token, parent))
                    row += 1
                # The next depth runs the best-scored of these (ties: the earlier node).
                nxt = self.tree_branching[depth + 1] if depth + 1 < len(self.tree_branching) else 0
                frontier[seq.seq_id] = sorted(sorted(newest, key=lambda i: -tree[i][0])[:nxt])
                for i in frontier[seq.seq_id]:
                    run_of[seq.seq_id][i] = len(run_parents[seq.seq_id])
                    run_parents[seq.seq_id].append(run_of[seq.seq_id][tree[i][3]])
                    seq.output_token_ids.append(tree[i][2])  # fed at the next depth
        for seq, _ in active:
            tree, prop = nodes[seq.seq_id], out[seq.seq_id]
            best = sorted(range(len(tree)), key=lambda i: (-tree[i][0], tree[i][1], i))[: self.tree_max_nodes]
            kept = sorted(best, key=lambda i: (tree[i][1], i))  # breadth-first
            place = {i: j for j, i in enumerate(kept)}
            prop.token_ids = [tree[i][2] for i in kept]
            prop.parents = [place[tree[i][3]] if tree[i][3] >= 0 else -1 for i in kept]

    def _tree_depths(self, active, base: dict, frontier: dict, parents: dict):
        """One forward per tree depth, while any sequence still drafts: each such sequence runs its
        frontier's nodes (the last len(frontier) tokens fed; depth 0: the catch-up chunk, whose last
        row is the root) under the tree mask of `parents` (relative to base). Yields (depth, its
        branching width, those sequences, logits by row); the caller grows frontier and parents
        for the next depth."""
        for depth, width in enumerate(self.tree_branching):
            live = [(s, r) for s, r in active if min(r.k, len(self.tree_branching)) > depth
                    and frontier[s.seq_id] and self._room(s)]
            if not live:
                return
            entries = []
            for s, _ in live:
                e = ScheduledSeq(s, s.num_uncomputed_tokens, len(frontier[s.seq_id]))
                if depth:
                    e.tree_base, e.tree_parents = base[s.seq_id], parents[s.seq_id]
                entries.append(e)
            logits = self.runner.run(entries)
            for e in entries:
                e.seq.num_computed_tokens += e.num_new_tokens
            yield depth, width, live, logits

    def _children(self, logits: torch.Tensor, width: int, req: ProposeRequest, gen):
        """Up to width (token, q) children of a node: the top tokens (q one-hot: None), or draws
        without replacement from the top-k distribution, each with its conditional q."""
        if width <= 0:
            return []
        if not self._sampled(req):
            return [(int(t), None) for t in logits.topk(min(width, logits.shape[-1])).indices]
        top = (logits.float() / req.temperature).topk(min(self.top_k, logits.shape[-1]))
        probs, ids, out = top.values.softmax(-1), top.indices, []
        for _ in range(min(width, int((probs > 0).sum()))):
            keep = probs > 0
            q = probs[keep] / probs[keep].sum()
            choice = int(torch.multinomial(q, 1, generator=gen))
            q_ids = ids[keep]
            out.append((int(q_ids[choice]), (q_ids.tolist(), q.tolist())))
            probs = probs.masked_fill(ids == q_ids[choice], 0.0)
        return out

    def _default_num_blocks(self, block_size: int) -> int:
        """Room for DRAFT_SEQUENCES full-length sequences, within the CPU cache budget the verifier's
        takes too: a real draft model's context is long (Qwen2.5-0.5B's 32,768 tokens x 64 sequences
        would be 25 GB). A sequence the cache has no room for gets no drafts (_room)."""
        per_seq = -(-self.max_model_len // block_size)
        blocks = per_seq * DRAFT_SEQUENCES
        if self.device.type == "cpu":
            per_block = ModelRunner.kv_bytes_per_block(self.model, block_size, self.dtype)
            blocks = min(blocks, max(1, int(kv_memory.default_cpu_budget("draft model KV cache") // per_block)))
        return blocks

    def _room(self, seq: Sequence) -> bool:
        return self.blocks.allocate(seq, len(seq), self.blocks.match_prefix(seq))

    def _sync(self, req: ProposeRequest) -> Sequence | None:
        """Apply the committed delta; None when out of sync (the caller resends the history)."""
        seq = self.seqs.get(req.seq_id)
        if req.full_history:
            if seq is not None:
                self.blocks.free(seq)
            seq = Sequence(req.new_tokens, _GREEDY, seq_id=req.seq_id)
            self.seqs[req.seq_id] = seq
        elif seq is None or len(seq) + len(req.new_tokens) != req.num_tokens:
            self.release([req.seq_id])
            return None
        else:
            seq.output_token_ids.extend(req.new_tokens)
        if len(seq) != req.num_tokens:
            self.release([req.seq_id])
            return None
        self.grammar.sync(req.seq_id, req.structured_outputs, req.new_tokens, req.num_prompt_tokens, req.full_history)
        return seq

    def release(self, seq_ids: list[int]) -> None:
        self.grammar.release(seq_ids)
        for sid in seq_ids:
            seq = self.seqs.pop(sid, None)
            if seq is not None:
                self.blocks.free(seq)


def _parallel_drafting(model_dir) -> tuple[int | None, int]:
    """(the mask token, the most drafts one forward may make) of a parallel (PARD) draft model,
    or (None, 0). The count is what the drafter was trained for where its config says so."""
    try:
        with open(f"{model_dir}/config.json") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None, 0
    token = config.get("pard_token")
    if token is None:
        return None, 0
    return int(token), int((config.get("specd_drafter") or {}).get("parallel_drafts", 1 << 30))
