"""Triton kernels for the GPU path, each next to its pure-PyTorch reference (specd.kernels)."""
