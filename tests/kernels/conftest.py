"""Kernel tests: on a machine without a GPU, Triton kernels run in its interpreter.

TRITON_INTERPRET must be set before a kernel module is imported (Triton reads it when
the @triton.jit decorator runs), so it is set here, ahead of every test module.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
