"""Build a proposer from a SpeculativeConfig (the offline engine and the drafter service share it)."""
from __future__ import annotations

from pathlib import Path

import torch

from specd.config import SpeculativeConfig
from specd.models.gguf_convert import find_gguf


def make_proposer(spec: SpeculativeConfig, target_vocab_size: int | None, device: torch.device | str = "cpu",
                  seed: int | None = None, target_vocab_hash: str | None = None):
    """target_vocab_size None: no target to check against (the drafter service; the verifier
    checks vocabularies at registration). target_vocab_hash: the target's token table, which a
    suffix index's datastore must share (None: not checked). seed: of the stream unseeded sampled
    drafts draw from (None: random)."""
    from specd.proposers.base import PROPOSERS

    if spec.method == "combined":
        from specd.config import DEFAULT_TREE_NODES
        from specd.proposers.combined import CombinedProposer

        # A member without its own k drafts the combined config's.
        members = [m if "num_speculative_tokens" in m.model_fields_set
                   else m.model_copy(update={"num_speculative_tokens": spec.num_speculative_tokens})
                   for m in spec.members]
        return CombinedProposer([make_proposer(m, target_vocab_size, device, seed, target_vocab_hash) for m in members],
                                spec.tree.max_nodes if spec.tree else DEFAULT_TREE_NODES)
    if spec.method == "draft_model":
        from specd.proposers.draft_model import DraftModelProposer

        tree = spec.tree
        proposer = DraftModelProposer(spec.model, dtype=spec.draft_dtype, device=device,
                                      sample_method=spec.draft_sample_method, top_k=spec.draft_top_k, seed=seed,
                                      tree_branching=tree.branching if tree else None,
                                      tree_max_nodes=tree.max_nodes if tree else 32,
                                      tree_dynamic=bool(tree and tree.dynamic),
                                      mask_structured=spec.draft_structured_outputs)
        if target_vocab_size is not None and proposer.vocab_size != target_vocab_size:
            raise ValueError(f"draft model vocabulary ({proposer.vocab_size}) does not match the target's "
                             f"({target_vocab_size}); a drafter must share the target's tokenizer")
        return proposer
    if spec.method in ("eagle", "eagle3", "medusa", "mlp_speculator"):
        from specd.proposers.hidden_state import HiddenStateProposer

        proposer = HiddenStateProposer(spec.method, spec.model, spec.target_model,
                                       num_speculative_tokens=spec.num_speculative_tokens, dtype=spec.draft_dtype,
                                       device=device, sample_method=spec.draft_sample_method,
                                       top_k=spec.draft_top_k, seed=seed,
                                       mask_structured=spec.draft_structured_outputs)
        if target_vocab_size is not None and proposer.vocab_size != target_vocab_size:
            raise ValueError(f"{spec.method} target vocabulary ({proposer.vocab_size}) does not match the "
                             f"serving target's ({target_vocab_size})")
        return proposer
    options = {k: v for k, v in spec.model_dump().items() if k.startswith(("prompt_lookup_", "suffix_decoding_"))}
    if spec.tree is not None:  # ngram: earlier matches with different next tokens as branches
        options.update(tree_branches=spec.tree.branching[0], tree_max_nodes=spec.tree.max_nodes)
    proposer = PROPOSERS[spec.method](num_speculative_tokens=spec.num_speculative_tokens, **options)
    if getattr(proposer, "datastore", None) is not None and target_vocab_hash is not None:
        proposer.datastore.check_vocab(target_vocab_hash)
    return proposer


def in_process_proposer(spec: SpeculativeConfig, engine):
    """The proposer spec names, built beside an LLMEngine in its process (its proposer_factory)."""
    from specd.engine.sampler import draft_seed

    if spec.method is None:
        raise ValueError("speculative config needs 'method' (ngram, suffix or draft_model) "
                         "when no drafter service provides proposals")
    gguf_drafter = spec.method == "draft_model" and find_gguf(Path(spec.model).expanduser()) is not None
    if spec.quantization == "gguf" and not gguf_drafter:
        raise ValueError(f"speculative config: quantization 'gguf' needs a .gguf draft model, not {spec.model!r}")
    # A draft model in this process computes in the target's dtype; a .gguf one in its own types
    # (bfloat16 activations), unless draft_dtype names a dtype to dequantize it to.
    if spec.draft_dtype == "auto" and not gguf_drafter:
        spec = spec.model_copy(update={"draft_dtype": str(engine.dtype).removeprefix("torch.")})
    vocab_hash = None  # hashing the token table takes ~0.2 s: only for a datastore to check
    if any(m.suffix_decoding_datastore for m in [spec, *(spec.members or [])]):
        from specd.models.tokenizer import vocab_hash_of

        vocab_hash = vocab_hash_of(engine.model_dir)
    # Its unseeded stream must not be the sampler's (same seed, same numbers: drafts correlated
    # with the acceptance uniforms); derived from it, runs stay reproducible.
    return make_proposer(spec, target_vocab_size=engine.arch.vocab_size, device=engine.device,
                         seed=draft_seed(engine.config.seed, -1), target_vocab_hash=vocab_hash)
