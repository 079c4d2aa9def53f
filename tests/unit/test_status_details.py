"""`loraplane.status_details.bound_details`: what a bounded status message keeps."""

from __future__ import annotations

from loraplane.formats.adapter_file import AdapterError
from loraplane.status_details import MAX_DETAILS_BYTES, bound_details, encoded_size


def test_short_messages_pass_unchanged() -> None:
    text = "adapter 3 not found; registered ids: [0, 1]\nsecond line: 100%"
    assert bound_details(text) == text


def test_encoded_size_counts_percent_encoding() -> None:
    assert encoded_size("abc") == 3
    assert encoded_size("%") == 3
    assert encoded_size("\n") == 3
    assert encoded_size("é") == 6  # two UTF-8 bytes, each %XX


def test_a_list_of_problems_keeps_whole_problems() -> None:
    problems = [f"tensor 'blk.{i}.attn_q.weight': unexpected suffix" for i in range(500)]
    text = str(AdapterError("/models/base.gguf", problems))
    out = bound_details(text)
    assert encoded_size(out) <= MAX_DETAILS_BYTES
    lines = out.split("\n")
    assert lines[0] == "/models/base.gguf: LoRA adapter rejected (500 problems)"
    kept = lines[1:-1]
    assert kept == [f"  - {p}" for p in problems[: len(kept)]]
    assert lines[-1] == f"  … ({500 - len(kept)} more problems)"
    # as many as fit: one more would not
    assert encoded_size("\n".join(lines[:-1]) + f"\n  - {problems[len(kept)]}\n  … (0 more problems)") > 4096 - 40


def test_other_text_is_cut_by_bytes_and_says_how_many() -> None:
    text = "x" * 10_000
    out = bound_details(text)
    assert encoded_size(out) <= MAX_DETAILS_BYTES
    head, marker = out.split("… (")
    assert set(head) == {"x"}
    assert marker == f"{10_000 - len(head)} more bytes)"


def test_multibyte_text_is_cut_on_a_character() -> None:
    text = "ü" * 5000  # 10 000 UTF-8 bytes, 30 000 encoded
    out = bound_details(text)
    assert encoded_size(out) <= MAX_DETAILS_BYTES
    head = out.split("… (")[0]
    assert set(head) == {"ü"}
    assert out.endswith(f"({10_000 - len(head.encode())} more bytes)")


def test_a_problem_list_whose_head_is_huge_falls_back_to_bytes() -> None:
    text = "h" * 9000 + "\n  - a\n  - b"
    out = bound_details(text)
    assert encoded_size(out) <= MAX_DETAILS_BYTES
    assert out.endswith("more bytes)")


def test_both_servers_put_the_bound_outermost() -> None:
    from loraplane.status_details import BoundedStatusInterceptor
    from worker.config import WorkerConfig
    from worker.rpc.server import server_interceptors

    assert isinstance(server_interceptors(WorkerConfig(worker_secret="s"))[0], BoundedStatusInterceptor)
