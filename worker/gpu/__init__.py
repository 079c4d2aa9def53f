"""The GPU engine: the forward pass's device kernels and, beside them, its buffers and graphs.

Chosen at start by device (a CUDA worker), beside the CPU kernels of
``worker.runtime.kernels``, which keep their own paths and bit-for-bit results.

Importing this package (or ``worker.gpu.kernels``) imports nothing heavy: Triton and
FlashInfer are imported by the kernel modules at their first call, so a CPU-only machine without
either can import the worker.
"""
