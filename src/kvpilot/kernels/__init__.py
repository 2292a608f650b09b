"""Attention kernels over the paged KV cache: torch references (``reference``) and, on
CUDA, Triton kernels. Imports torch/triton only, nothing else from kvpilot."""
