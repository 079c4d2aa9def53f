"""loraplane worker: LoRA, the forward pass, serving, the gRPC edge, offline tools (the formats it
reads, GGUF, adapter files, the tokenizer, the architecture table, are `loraplane.formats`).

``OMP_WAIT_POLICY`` defaults to ``PASSIVE`` here, before anything imports torch (libgomp reads
it once at load): with the default spin-wait, every OpenMP region of a decode step waits for a
descheduled spinning sibling when another process holds a core, and a step that takes tens of
ms takes 0.4–1.5 s (measured on the 2-core machines; ``worker/runtime/kernels/README.md``).
Set ``OMP_WAIT_POLICY=ACTIVE`` in the environment to opt out on a dedicated machine.

It governs torch's own ops (norms, rope, elementwise, attention); our C matmul kernels run on
their own thread pool (``LORAPLANE_KERNEL_THREADS``, ``LORAPLANE_KERNEL_SPIN_US``,
``LORAPLANE_KERNEL_SPIN_BACKOFF_MS``: ``worker.runtime.kernels.library.threads_config``).
"""

import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
