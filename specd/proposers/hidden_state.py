"""Hidden-state proposers: `eagle`, `eagle3` (a head chained k steps over its own KV cache) and
`medusa`, `mlp_speculator` (all k drafts from the last feature row in one pass).

Per sequence the proposer keeps the committed tokens and what the head needs of the target's
features (the module docstring of base.py fixes their rows): EAGLE heads keep their KV over
the committed pairs (token j with the row that predicted it, at head position j - 1) and the
head's output at the last pair; drafting appends k - 1 pairs and rolls them back afterwards,
as draft_model does. Medusa and the MLP speculator keep the last row only. A request whose
tokens or feature rows do not line up with that state is answered resync=True. EAGLE heads keep
the KV of released histories in a prefix cache (heads/prefix_cache.py): a full history starts
from the longest prefix held, and its rows may start there (ProposeRequest.features_from); one
whose rows start past what is held is answered resync with history_held.

Greedy drafts ship ids only (q one-hot). Sampled drafts come from the head's top-k truncated,
renormalised distribution at the request's temperature, seeded by (request seed, position)
like draft_model's (draft_sampling.py), and ship that sparse q.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specd.engine.loader import default_device, resolve_dtype
from specd.engine.model.linear import adopt_linears, fast_linear
from specd.proposers.base import Proposal, ProposeRequest, feature_rows
from specd.proposers.draft_grammar import DraftGrammars
from specd.proposers.draft_sampling import SampledDrafts
from specd.proposers.pipeline import record_alternatives
from specd.proposers.heads.checkpoint import load_target_pieces, read_config, read_tensors, resolve_head_dir
from specd.proposers.heads.prefix_cache import BLOCK, HeadPrefixCache

CHAIN_METHODS = ("eagle", "eagle3")
PARALLEL_METHODS = ("medusa", "mlp_speculator")
METHODS = CHAIN_METHODS + PARALLEL_METHODS
FINGERPRINT_KEY = "specd_target_fingerprint"  # in a head's config.json


@dataclass
class _State:
    tokens: list[int]
    kv: object | None = None  # chain heads: KVCache over the committed pairs
    last: torch.Tensor | None = None  # chain: head output at the last pair; parallel: last feature row
    extra: dict = field(default_factory=dict)


class HiddenStateProposer(SampledDrafts):
    def __init__(self, method: str, model: str, target: str, *, num_speculative_tokens: int = 4,
                 dtype: str = "auto", device: str | torch.device = "auto", sample_method: str = "greedy",
                 top_k: int = 16, seed: int | None = None, mask_structured: bool = True,
                 prefix_cache_mb: float = 64):
        if method not in METHODS:
            raise ValueError(f"unknown hidden-state method {method!r}; known: {', '.join(METHODS)}")
        self.method = method
        self.device = device if isinstance(device, torch.device) else default_device(device)
        head_dir = resolve_head_dir(model)
        cfg = read_config(head_dir)
        where = f"{method} checkpoint {model}"
        # specd's own medusa / mlp_speculator heads share the target's embeddings and LM head
        pieces = load_target_pieces(target, embed=method in CHAIN_METHODS or cfg.get("specd_embeddings") == "target",
                                    lm_head=method == "eagle" or cfg.get("specd_lm_head") == "target")
        self.arch = pieces.arch
        # what the drafter's Info says of the target (services/drafter/main.py)
        self.hidden_size, self.target_layers = pieces.arch.hidden_size, pieces.arch.num_layers
        self.vocab_size = pieces.arch.vocab_size
        self.dtype = resolve_dtype(dtype, pieces.arch, self.device)
        L = pieces.arch.num_layers
        if method == "eagle3":
            from specd.proposers.heads.eagle3 import load_eagle3

            ids = cfg.get("eagle_aux_hidden_state_layer_ids")
            self.feature_layers = tuple(int(i) for i in ids) if ids else (2, L // 2, L - 3)
            self.head = load_eagle3(cfg, read_tensors(head_dir), pieces, len(self.feature_layers), self.dtype,
                                    self.device, where)
        elif method == "eagle":
            from specd.proposers.heads.eagle import load_eagle

            self.feature_layers = (L,)
            self.head = load_eagle(cfg, read_tensors(head_dir), pieces, self.dtype, self.device, where)
        elif method == "medusa":
            from specd.proposers.heads.medusa import FILES, load_medusa

            self.feature_layers = (L,)
            self.head = load_medusa(cfg, read_tensors(head_dir, FILES), pieces.arch.hidden_size,
                                    pieces.arch.vocab_size, self.dtype, self.device, where, pieces.lm_head)
        else:
            from specd.proposers.heads.mlp_speculator import load_mlp_speculator

            self.feature_layers = (L,)
            self.head = load_mlp_speculator(cfg, read_tensors(head_dir), pieces, self.dtype, self.device, where)
        # The engine's matmul path for the head's linears (specd/engine/model/linear.py): in bf16 on a
        # CPU, torch's own matmul took 2-10 ms per call here, most of a draft's cost.
        adopt_linears(self.head)
        if isinstance(getattr(self.head, "lm_head", None), torch.Tensor):  # EAGLE-1 scores with a plain tensor
            self.head.lm_head_linear = fast_linear(self.head.lm_head)
        if any(not 0 <= i <= L for i in self.feature_layers):
            raise ValueError(f"{where}: feature layers {self.feature_layers} outside [0, {L}] for this target")
        self.max_k = min(num_speculative_tokens, getattr(self.head, "max_k", num_speculative_tokens))
        self.one_forward = method == "medusa"  # every head reads the same row: a call's cost is flat in k
        self.max_positions = getattr(self.head, "max_positions", pieces.arch.max_position_embeddings)
        self._init_sampling(sample_method, top_k, seed)
        self.seqs: dict[int, _State] = {}
        self.grammar = DraftGrammars(pieces.dir, pieces.arch.vocab_size, pieces.arch.eos_token_ids,
                                     enabled=mask_structured)
        # specd.engine.model.fingerprint of the target the head was trained for, when its trainer wrote it
        # (published checkpoints carry none: the verifier then checks layers and hidden size only)
        self.target_fingerprint = str(cfg.get(FINGERPRINT_KEY) or "")
        self.prefix_cache = HeadPrefixCache(int(prefix_cache_mb * 2**20), f"{method}{self.feature_layers}".encode()) \
            if method in CHAIN_METHODS and prefix_cache_mb > 0 else None
        self.lacking: dict[int, int] = {}  # seq_id -> pairs held, for a resync whose rows started too late

    @property
    def supports_tentative(self) -> bool:
        """Pipelined drafting (specd/proposers/pipeline.py): EAGLE-1's own states stand in for
        the target's feature rows; EAGLE-3 fuses three layers into them, and the parallel heads
        keep no state to draft ahead from."""
        return self.method == "eagle"

    # Tentative requests fork the state (a copy of the head's KV): many outcomes of one sequence
    # draft in one batch.
    tentative_batches = True

    def propose(self, batch: list[ProposeRequest]) -> list[Proposal]:
        out: list[Proposal | None] = [None] * len(batch)
        catch_up: list[tuple[_State, list[int], torch.Tensor]] = []  # chain heads: new pairs to run
        synced: list[tuple[int, _State, ProposeRequest]] = []
        with torch.inference_mode():
            for i, req in enumerate(batch):
                if req.tentative:  # a fork: the committed state plus the delta, on a copy of its KV
                    state = self.seqs.get(req.seq_id)
                    if not self._tentative_fits(req, state):
                        out[i] = Proposal(seq_id=req.seq_id, token_ids=[])
                        continue
                    state = _State(state.tokens + list(req.new_tokens), state.kv.fork(), state.last)
                    catch_up.append((state, list(req.new_tokens), req.features.to(self.device, self.dtype)))
                else:
                    state = self._sync(req, catch_up)
                if state is None:
                    out[i] = Proposal(seq_id=req.seq_id, token_ids=[], resync=True,
                                      history_held=self.lacking.pop(req.seq_id, 0))
                else:
                    synced.append((i, state, req))
            if catch_up:  # every sequence's new pairs in one ragged forward
                outs = self.head.forward([s.kv for s, _, _ in catch_up], [len(t) for _, t, _ in catch_up],
                                         torch.tensor([t for _, ts, _ in catch_up for t in ts], device=self.device),
                                         torch.cat([r for _, _, r in catch_up]), from_target=True)
                ends = torch.tensor([len(t) for _, t, _ in catch_up]).cumsum(0) - 1
                for (state, _, _), row in zip(catch_up, outs[ends.to(outs.device)]):
                    state.last = row
            active, where = [], []
            for i, state, req in synced:
                k = min(req.k, self.max_k, self.max_positions - len(state.tokens))
                if k > 0 and state.last is not None:
                    active.append((state, req, k))
                    where.append(i)
                else:
                    out[i] = Proposal(seq_id=req.seq_id, token_ids=[])
            if active:
                for i, prop in zip(where, self._draft(active)):
                    out[i] = prop
        return out

    def release(self, seq_ids: list[int]) -> None:
        self.grammar.release(seq_ids)
        for sid in seq_ids:
            state = self.seqs.pop(sid, None)
            if state is not None and state.kv is not None and self.prefix_cache is not None:
                self.prefix_cache.store(state.tokens, state.kv)

    # -- state ---------------------------------------------------------------
    def _tentative_fits(self, req: ProposeRequest, state: _State | None) -> bool:
        """A tentative request must apply cleanly (_sync drops the state of one that does not)."""
        width = len(self.feature_layers) * self.arch.hidden_size
        rows = req.features
        return (self.supports_tentative and state is not None and not req.full_history
                and len(state.tokens) + len(req.new_tokens) == req.num_tokens <= self.max_positions
                and rows is not None and rows.dim() == 2 and tuple(rows.shape) == (len(req.new_tokens), width))

    def _sync(self, req: ProposeRequest, catch_up: list) -> _State | None:
        """Apply the committed delta and its feature rows (chain heads: queue the new pairs on
        catch_up); None when out of sync (state dropped)."""
        state = self.seqs.get(req.seq_id)
        rows = req.features
        width = len(self.feature_layers) * self.arch.hidden_size
        ok_rows = rows is not None and rows.dim() == 2 and rows.shape == (feature_rows(req), width)
        layers = tuple(getattr(req, "feature_layers", ()) or ())  # when the sender names them
        ok_rows = ok_rows and (not layers or layers == self.feature_layers)
        if not ok_rows or (not req.full_history and (state is None or
                                                     len(state.tokens) + len(req.new_tokens) != req.num_tokens)):
            self.release([req.seq_id])
            return None
        if req.full_history:
            self.release([req.seq_id])
            if len(req.new_tokens) != req.num_tokens:
                return None
            state = _State(list(req.new_tokens))
            pair_tokens = req.new_tokens[1:]  # the first token has no predicting row
            if self.method in CHAIN_METHODS:
                state.kv = self.head.new_cache()
                held = self._restore(state, req)
                if held is None:
                    return None
                pair_tokens, rows = pair_tokens[held:], rows[held - req.features_from:]
            self.seqs[req.seq_id] = state
        else:
            state.tokens.extend(req.new_tokens)
            pair_tokens = req.new_tokens
        self.grammar.sync(req.seq_id, req.structured_outputs, req.new_tokens, req.num_prompt_tokens, req.full_history)
        if rows.shape[0] == 0:
            return state
        rows = rows.to(self.device, self.dtype)
        if self.method in PARALLEL_METHODS:
            state.last = rows[-1]
        elif len(state.tokens) > self.max_positions:
            self.release([req.seq_id])  # beyond the head's rotary table: no drafts for this one
            return None
        else:
            catch_up.append((state, list(pair_tokens), rows))
        return state

    def _restore(self, state: _State, req: ProposeRequest) -> int | None:
        """A new chain state's pairs from the prefix cache (at least one pair is left to run, for
        the head's output at the last pair): how many, or None when the request's rows start past
        them (self.lacking says how many are held)."""
        held = self.prefix_cache.held(state.tokens, len(state.tokens) - 2) if self.prefix_cache is not None else []
        if len(held) * BLOCK < req.features_from:
            self.lacking[req.seq_id] = len(held) * BLOCK
            return None
        return self.prefix_cache.restore(state.kv, held) if held else 0

    # -- drafting --------------------------------------------------------------
    def _draft(self, active: list[tuple[_State, ProposeRequest, int]]) -> list[Proposal]:
        token_ids = getattr(self.head, "token_ids", None)  # EAGLE-3: draft index -> target id
        props = []
        for _, req, _ in active:
            sampled = self._sampled(req)
            props.append(Proposal(seq_id=req.seq_id, token_ids=[], q_ids=[] if sampled else None,
                                  q_probs=[] if sampled else None, draft_probs=[] if req.alternatives else None,
                                  alternatives=[] if req.alternatives else None))
        states: list[list[torch.Tensor]] = [[] for _ in active]  # chain heads: each draft's state
        # the grammar's masks (draft_grammar.py): not for tentative drafts, whose state is not the matcher's
        mask_ids = [None if req.tentative else req.seq_id for _, req, _ in active]
        parallel = self.method in PARALLEL_METHODS

        def pick(b: int, i: int, logits: torch.Tensor) -> int:  # logits [V_head] float32 -> a target id
            req, prop = active[b][1], props[b]
            if parallel:  # one row at a time (chains mask a step's rows together, below)
                logits = self.grammar.mask([mask_ids[b]], logits[None], token_ids)[0]
            if self._sampled(req):
                idx, ids, probs = self._sample_sparse(logits, req, req.num_tokens + i)
                if token_ids is not None:
                    ids = token_ids[torch.tensor(ids, device=token_ids.device)].tolist()
                prop.q_ids.append(ids)
                prop.q_probs.append(probs)
            else:
                idx = int(logits.argmax())
            token = idx if token_ids is None else int(token_ids[idx])
            prop.token_ids.append(token)
            if req.alternatives:
                record_alternatives(prop, logits, token, req, token_ids)
            if not req.tentative:
                self.grammar.push(req.seq_id, token)
            return token

        ks = [k for _, _, k in active]
        if parallel:
            self.head.draft(torch.stack([s.last for s, _, _ in active]), [s.tokens[-1] for s, _, _ in active],
                            ks, pick)
            self.grammar.end_call()
            return props
        committed = [s.kv.length for s, _, _ in active]
        h = torch.stack([s.last for s, _, _ in active])  # [B, H]: the head's state per sequence
        live = list(range(len(active)))
        for i in range(max(ks)):
            logits = self.grammar.mask([mask_ids[b] for b in live], self.head.logits(h), token_ids)  # [B_live, V_head]
            tokens = [pick(b, i, row) for b, row in zip(live, logits)]
            for b, row in zip(live, h):
                states[b].append(row)
            keep = [j for j, b in enumerate(live) if ks[b] > i + 1 and not self.grammar.stopped(mask_ids[b])]
            if not keep:
                break
            # each drafted token with the head's predicted state is that sequence's next pair
            live = [live[j] for j in keep]
            h = self.head.forward([active[b][0].kv for b in live], [1] * len(live),
                                  torch.tensor([tokens[j] for j in keep], device=self.device), h[keep],
                                  from_target=False)
        self.grammar.end_call()
        for (state, _, _), n in zip(active, committed):
            state.kv.truncate(n)  # state holds committed pairs only
        for (_, req, _), prop, rows in zip(active, props, states):
            if req.alternatives and rows:
                prop.draft_features = torch.stack(rows)
        return props


def _register() -> None:
    from functools import partial

    from specd.proposers.base import PROPOSERS

    for m in METHODS:
        PROPOSERS[m] = partial(HiddenStateProposer, m)


_register()
