"""Host→device uploads through pinned staging buffers, for the engine's static device buffers.

A step's inputs are written on the host and copied into device buffers whose addresses never
change (captured CUDA graphs read them in place). On CUDA the host side is pinned memory and
the copy is asynchronous (``non_blocking``), so the host does not wait for the GPU to drain
its queue; the host must then not rewrite the staging buffer before that copy has run, which
an event recorded after the copy guards (`Upload.wait`). On the CPU the copy is a plain
``copy_``.
"""

from __future__ import annotations

from typing import Any

import torch


class Upload:
    """One device buffer ``dst`` fed from a host staging twin of the same shape and dtype.

    Use: ``up.wait()``, write rows of ``up.host``, ``up.push(0, n)``.

    Args:
        dst: the device buffer (any shape; rows are its first dimension). Never reallocated.
    """

    def __init__(self, dst: torch.Tensor):
        self.dst = dst
        self._cuda = dst.device.type == "cuda"
        self.host = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=self._cuda)
        self._done: Any = None  # torch.cuda.Event of the last push (CUDA only)

    def wait(self) -> None:
        """Block until the last push has read ``host`` (a no-op on the CPU)."""
        if self._done is not None:
            self._done.synchronize()

    @torch.inference_mode()  # the device buffers are inference tensors (written under it)
    def push(self, lo: int = 0, hi: int | None = None) -> None:
        """Copy rows ``lo..hi-1`` (``hi`` None: to the end) of ``host`` into the same rows of
        ``dst``; asynchronous on CUDA."""
        self.dst[lo:hi].copy_(self.host[lo:hi], non_blocking=self._cuda)
        if self._cuda:
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record()


__all__ = ["Upload"]
