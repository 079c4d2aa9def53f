"""Device kernels of the GPU engine (Triton, with torch references beside each).

- ``lora``: the gathered multi-LoRA product over the adapter slot pool (shrink ``x·Aᵀ`` then
  expand ``·B``, per row by slot; punica/S-LoRA/vLLM BGMV and SGMV), plus torch ops for the
  embedding and MoE experts' side branches.
- ``attention``: paged KV writes, decode attention over a paged KV cache (split-K, GQA, sliding
  window, logit soft-capping), prefill attention over a sequence's pages (torch SDPA).
- ``flashinfer_backend``: FlashInfer's paged decode/prefill as an optional attention backend,
  used on CUDA when the ``cuda`` extra is installed.

Triton is imported on first use (``worker.gpu.kernels.triton_env``). The kernels run on
CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
Triton is first imported), which is how the tests check them on a machine without a GPU.

Shapes are torch order throughout.
"""
