"""A short fingerprint of a target's weights, for hidden-state drafters.

A head trained on one target's hidden states is useless (not harmful: verification stays
exact) on another's. The trainer records the fingerprint of the target it trained for, the
drafter reports it in Info, and the verifier refuses a mismatch. It is computed from the
loaded model, so the same weights give the same fingerprint whatever file they came from
(safetensors, GGUF) and whatever dtype they are served in: each tensor's name and shape,
and its first values rounded to bfloat16 (exact for bf16 checkpoints, and the same rounding
for every wider load of the same values). Taken by the loader right after the weights are
read, before the linears are repacked (CausalLM.fingerprint).
"""
from __future__ import annotations

import hashlib

import torch

VALUES_PER_TENSOR = 64


def weights_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        head = p.detach().reshape(-1)[:VALUES_PER_TENSOR].to("cpu", torch.bfloat16)
        h.update(f"{name}:{tuple(p.shape)}:".encode())
        h.update(head.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:32]
