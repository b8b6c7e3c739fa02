"""The in-process part of the default stack, for benches that watch the controller in one process:
the default target in bf16 with the suffix index (k 8, the committed datastore), as `specd up`'s
verifier drafts by default."""
from __future__ import annotations


def in_process_stack(threads: int):
    """-> (specd.LLM with that drafter and `threads` torch threads, its speculative config)."""
    import torch

    torch.set_num_threads(threads)
    from specd.llm import LLM
    from specd.models import model_store

    spec = {"method": "suffix", "num_speculative_tokens": 8,
            "suffix_decoding_datastore": str(model_store.committed_datastore_dir())}
    return LLM(model_store.default_target(), dtype="bfloat16", speculative_config=spec), spec
