"""The compute kernels (specd.kernels), each checked in tests/kernels against a straight PyTorch path.

CPU: C++ fused ops (cpu_*.cpp, built once per machine by cpu_ops.py into torch.ops.specd_cpu): the
bf16 and GGUF-block matmuls, paged attention, the decoder layer's small steps and the whole layer
stack in one call, the sampler's passes (sampling_ops.py picks them or torch). GPU: Triton kernels
for paged attention, batch-invariant and int8/int4 matmuls, and rejection sampling. Rejection
sampling's public entry point (rejection_sampler.py) runs Triton on CUDA tensors and its PyTorch
reference elsewhere; token trees have their own reference (tree_rejection_sampler.py).
"""
