"""Limits shared by both planes and the clients: gRPC message sizes, adapter scales and names.

Message sizes: one constant for everything: every large payload is chunked (client → control plane uploads,
control plane → worker ``LoadAdapter`` streams), so no single message has to hold a whole
adapter. The largest unchunked messages are a ``GenerateEvent`` carrying prompt log-probs
(``n_ctx`` tokens × top-N entries: a few MiB at most) and adapter/worker listings. 64 MiB
covers those with a wide margin while bounding what one bad peer can make a server buffer
(gRPC allocates the whole message before a handler sees it).
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest gRPC message either plane sends or accepts, in bytes (both directions)."""

CHUNK_BYTES = 1 * 1024 * 1024
"""Payload bytes per chunk of a streamed adapter upload / push (well under the limit)."""

GRPC_MESSAGE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
"""Channel/server options applying ``MAX_MESSAGE_BYTES`` in both directions."""

HTTP_MAX_BODY_BYTES = 16 * 1024 * 1024
"""Default largest HTTP request body, in bytes (``--http-max-body-bytes``): answered 413 before
it is read. It exceeds the largest prompt any worker accepts (``worker.serving.engine.
prompt_byte_limit``: 131 071 tokens × 48-byte pieces ≈ 6 MiB, ×2 for JSON's ``\\uXXXX``
escapes) and stays under `MAX_MESSAGE_BYTES`, so a body that passes can become one gRPC request;
no larger, because decoding a body holds the interpreter lock (about 0.04 s per MiB of small
token ids on a busy 2-core machine), which delays every other response of the process."""

MAX_ADAPTER_SCALE = 1e4
"""Largest adapter scale a request, the default set or a start-up ``--lora-scaled`` may give
(scales are ``>= 0``; 0 detaches). Real scales are around 1 (llama-server and PEFT use 0 to a
few); past this an adapter's delta swamps the base weights' output (at 1e30 the logits are
NaN and every sampled token is the pad token), so such a scale is refused, not served."""

MAX_ADAPTER_NAME_BYTES = 256
"""Longest adapter name or alias, in UTF-8 bytes (as the workers bound tenant names): every
``/v1/models`` answer and adapter listing repeats each name."""
