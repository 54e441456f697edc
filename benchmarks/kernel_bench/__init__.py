"""Micro-benchmarks of the Triton kernels in `kiln.kernels` against their reference ops (CUDA)."""
