"""Engine configuration: one pydantic model; derived values are filled in one place."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DType = Literal["auto", "float32", "bfloat16", "float16"]


class EngineConfig(BaseModel):
    """Settings of the verifier engine (also used offline by specd.LLM)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    dtype: DType = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1, le=1024)
    # KV budget: num_kv_blocks wins when set; else kv_cache_gb; else enough for
    # max_num_seqs full-length sequences, capped by a default budget.
    kv_cache_gb: float | None = Field(default=None, gt=0)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    enable_chunked_prefill: bool = True
    # Reuse the KV of prompt prefixes seen before (specd/engine/block_manager.py).
    enable_prefix_caching: bool = True
    seed: int = 0
    # A token's logits do not depend on the rest of the step (row-chunked matmuls, float32
    # attention), so greedy speculation gives the plain tokens in bf16 too; checked at load.
    batch_invariant: bool = True


def format_validation_error(err: Exception) -> str:
    """One line from a pydantic ValidationError (field: reason; ...)."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        parts = []
        for e in errors():
            loc = ".".join(str(x) for x in e.get("loc", ()))
            msg = str(e.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(parts)
    return str(err)


# Token-tree sizes: the default node budget per sequence and step, and the most any tree may hold.
DEFAULT_TREE_NODES = 32
MAX_TREE_NODES = 256


class TreeConfig(BaseModel):
    """A static token-tree shape (EAGLE's static trees, SpecInfer's expansion): children per node
    at each depth. draft_model: the top-b tokens of the drafter (sampled: b draws without
    replacement) under each node of depth d - 1; ngram: up to branching[0] earlier matches
    with different next tokens, each continued as a chain. Nodes are bounded by max_nodes."""

    model_config = ConfigDict(extra="forbid")

    branching: list[int] | None = Field(default=None, min_length=1, max_length=32)  # None: combined only
    max_nodes: int = Field(default=DEFAULT_TREE_NODES, ge=1, le=MAX_TREE_NODES)
    # draft_model with greedy drafts: EAGLE-2's dynamic trees. At depth d the branching[d]
    # most probable nodes of the newest depth (by the drafter's path probability) are expanded,
    # each into its top branching[d] tokens; the max_nodes most probable nodes are sent.
    dynamic: bool = False

    def model_post_init(self, _context) -> None:
        if any(not 1 <= b <= 16 for b in self.branching or ()):
            raise ValueError(f"tree branching factors must be in [1, 16], got {self.branching}")


class SpeculativeConfig(BaseModel):
    """`--speculative-config` JSON, with vLLM's key names where vLLM has one."""

    model_config = ConfigDict(extra="forbid")

    # None: proposals come from drafter services (the verifier's pool), not an in-process proposer.
    # combined: one token tree from the drafts of `members` (specd/proposers/combined.py).
    method: Literal["ngram", "suffix", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator",
                    "combined"] | None = None
    model: str | None = None  # draft_model, or a hidden-state head's checkpoint: local directory or hub id
    # hidden-state heads (eagle, eagle3, medusa, mlp_speculator): the target they read (directory, hub
    # id or GGUF) for its layer count, hidden size, and the embeddings / LM head EAGLE heads borrow
    target_model: str | None = None
    num_speculative_tokens: int = Field(default=4, ge=1, le=32)
    # ngram (prompt lookup)
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    # suffix decoding
    suffix_decoding_max_tree_depth: int = Field(default=24, ge=1)
    suffix_decoding_max_cached_requests: int = Field(default=10000, ge=0)
    suffix_decoding_max_spec_factor: float = Field(default=1.0, gt=0)
    suffix_decoding_min_token_prob: float = Field(default=0.1, ge=0, le=1)
    # a datastore directory the suffix index drafts from where a request's own history has no draft
    # (specd/proposers/datastore.py)
    suffix_decoding_datastore: str | None = None
    # draft_model: greedy drafts, or drafts sampled from the drafter's top-k truncated
    # distribution (that sparse q is what the verifier uses for exact acceptance)
    draft_sample_method: Literal["greedy", "sampled"] = "greedy"
    draft_top_k: int = Field(default=16, ge=1, le=1024)
    # draft_model chains and hidden-state heads mask their own drafts with a constrained request's
    # grammar (the verifier keeps output exact either way; this only saves drafts it would cut)
    draft_structured_outputs: bool = True
    draft_dtype: DType = "auto"  # auto: the target's dtype in-process; a drafter service resolves it as a target would
    # vLLM's key for the draft model's quantization. None: as the checkpoint comes (a .gguf drafter computes
    # in its own quantized types on CPU under draft_dtype auto); "gguf": insist on that (an error otherwise)
    quantization: Literal["gguf"] | None = None
    # acceptance: strict is lossless; typical and synthetic are lossy and reported as such
    rejection_sample_method: Literal["strict", "typical", "synthetic"] = "strict"
    posterior_threshold: float = Field(default=0.09, gt=0, le=1)
    posterior_alpha: float = Field(default=0.3, gt=0, le=1)
    synthetic_acceptance_rate: float | None = Field(default=None, ge=0, le=1)
    # controller: choose k per step from the measured cost model (False: always k)
    adaptive: bool = True
    # token trees instead of chains (draft_model, ngram); None: chains. k still bounds the depth.
    # combined: only max_nodes is read, the merged tree's budget.
    tree: TreeConfig | None = None
    # combined: the proposers whose drafts are merged, first = tried first and kept first
    members: list["SpeculativeConfig"] | None = None

    def model_post_init(self, _context) -> None:
        heads = ("eagle", "eagle3", "medusa", "mlp_speculator")
        if self.method in ("draft_model", *heads) and not self.model:
            raise ValueError(f"method {self.method!r} needs 'model' (a directory or hub id)")
        if self.method not in ("draft_model", *heads) and self.model:
            raise ValueError(f"'model' is only used by method 'draft_model' and hidden-state heads, "
                             f"not {self.method!r}")
        if self.quantization is not None and self.method != "draft_model":
            raise ValueError(f"'quantization' is only used by method 'draft_model', not {self.method!r}")
        if self.quantization == "gguf" and self.draft_dtype != "auto":
            raise ValueError("quantization 'gguf' serves the drafter in its file's types: leave draft_dtype auto")
        if self.method in heads and not self.target_model:
            raise ValueError(f"method {self.method!r} needs 'target_model' (the target's directory or hub id)")
        if self.method not in heads and self.target_model:
            raise ValueError(f"'target_model' is only used by hidden-state heads, not {self.method!r}")
        if self.rejection_sample_method == "synthetic" and self.synthetic_acceptance_rate is None:
            raise ValueError("rejection_sample_method 'synthetic' needs synthetic_acceptance_rate")
        if self.tree is not None and self.method not in ("draft_model", "ngram", "combined"):
            raise ValueError(f"'tree' is supported by methods draft_model, ngram and combined, not {self.method!r}")
        if self.tree is not None and self.tree.branching is None and self.method != "combined":
            raise ValueError(f"method {self.method!r} needs 'tree.branching' (children per node at each depth)")
        self._check_members()
        if self.tree is not None and self.tree.dynamic and (
                self.method != "draft_model" or self.draft_sample_method != "greedy"):
            raise ValueError("dynamic trees are built by method 'draft_model' with greedy drafts only")
        if self.tree is not None and self.rejection_sample_method != "strict":
            raise ValueError("token trees are verified with rejection_sample_method 'strict' only")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")

    def _check_members(self) -> None:
        if self.method != "combined":
            if self.members is not None:
                raise ValueError(f"'members' is only used by method 'combined', not {self.method!r}")
            return
        if not self.members or len(self.members) < 2:
            raise ValueError("method 'combined' needs 'members': at least two proposer configs to merge")
        if any(m.method in (None, "combined") for m in self.members):
            raise ValueError("each member of 'combined' names its own method (not combined)")
        if self.rejection_sample_method != "strict":
            raise ValueError("method 'combined' builds token trees: rejection_sample_method 'strict' only")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From JSON text or a dict; unknown keys and bad values give one clear line."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e.msg} at position {e.pos}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        unknown = sorted(set(value) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known keys: {', '.join(cls.model_fields)}")
        try:
            return cls(**value)
        except ValueError as e:
            raise ValueError(f"speculative config: {format_validation_error(e)}") from None
