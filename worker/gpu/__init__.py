"""The GPU engine: what a worker runs when its device is CUDA, beside the CPU kernels of
``loraplane.worker.runtime`` (which keep their own path and results).

Modules import torch only; anything GPU-only (triton, flashinfer, CUDA graph objects) is
imported inside the functions that need it, so importing this package works on a CPU-only
machine.
"""
