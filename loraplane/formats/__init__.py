"""The formats both planes read, torch-free: GGUF reading and writing (`loraplane.formats.gguf`),
adapter-file validation (`loraplane.formats.adapter_file`), the tokenizer
(`loraplane.formats.tokenizer`), PEFT conversion (`loraplane.formats.convert_peft`) and the one
architecture table (`loraplane.formats.arch`).

Nothing here imports ``worker``, ``control_plane``, ``clients``, ``bench`` or ``torch``, and
nothing sets process-wide state at import (``tests/unit/test_plane_independence.py``).
"""
