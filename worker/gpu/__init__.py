"""The GPU engine: what a worker runs when its device is CUDA, beside the CPU kernels of
``loraplane.worker.runtime.kernels`` (weights dequantized on the device, graph caches, paged
KV cache, LoRA and sampling on the device). GPU-only packages (triton, flashinfer) are imported
lazily by the modules that need them, so importing this package works on a CPU-only machine."""
