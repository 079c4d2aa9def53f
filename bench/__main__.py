"""``python -m bench [--quick | --smoke] [--json OUT]`` (also ``loraplane bench``): the command line.

`_parser` reads the flags, `bench.scenarios` runs the selected scenarios (`SCENARIOS`: engine,
serving, prefix reuse, lifecycle, roofline, paging, long prompts, long context, bounds) in
order on one model, each printing its table as it finishes; ``--json OUT`` writes every figure
and ``--markdown OUT`` the tables for ``bench/RESULTS.md``. ``--synthetic`` runs on a
random-weight model of a real shape (`bench.synthetic`) and adds the device step
(`bench.device_step`). Exit code 0 when every scenario ran, 1 when one failed, 2 on a usage
error.

The scenarios and their figures: ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench.scenarios import run_scenarios
from loraplane.compute_spec import DEVICE_METAVAR, DTYPE_NAMES, check_device_spec

if TYPE_CHECKING:  # the real imports are lazy: torch must load after OMP_WAIT_POLICY is set
    from bench.profiles import Profile

SCENARIOS = {
    "1": "engine",
    "2": "serving",
    "3": "prefix",
    "4": "lifecycle",
    "5": "roofline",
    "6": "paging",
    "7": "longprompt",
    "8": "longctx",
    "9": "bounds",
}
DEFAULT_SEED = 1234
SYNTHETIC_BATCHES = (1, 16, 64)
"""Decode batches of scenario 1 and table 1b under ``--synthetic``: those the GPU step targets
are set at (docs/gpu.md)."""


def device_arg(text: str) -> str:
    """``--device`` for argparse: the normalized spelling (`loraplane.compute_spec.check_device_spec`).

    Raises:
        argparse.ArgumentTypeError: another spelling (argparse prints it as a usage error).
    """
    try:
        return check_device_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="loraplane bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="one repetition, fewer requests, K in {0, 4} (< 5 min)")
    size.add_argument("--smoke", action="store_true", help="the smallest run that exercises everything (tests)")
    ap.add_argument("--json", dest="json_out", metavar="OUT", help="write all results as JSON to OUT")
    ap.add_argument("--markdown", metavar="OUT", help="write the tables as Markdown to OUT")
    ap.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="f32",
        help="activation/compute dtype of the in-process model and the workers (default f32)",
    )
    ap.add_argument(
        "--weights",
        choices=["packed", "dequant"],
        default="packed",
        help="base weight form, in-process and in the workers (worker --weights): packed = GGUF "
        "quantized matrices multiplied by our kernels (default); dequant = the f32 reference",
    )
    ap.add_argument(
        "--device",
        type=device_arg,
        default="cpu",
        metavar=DEVICE_METAVAR,
        help="device of the in-process model and the workers (worker --device; cpu:0 is the CPU too; default cpu)",
    )
    ap.add_argument("--model", metavar="GGUF", help="base model (default: the embedded Gemma 3 270M)")
    ap.add_argument(
        "--synthetic",
        metavar="SHAPE",
        help="run on a random-weight GGUF of a real shape, written once into --synthetic-dir: qwen2.5-1.5b or "
        "llama-3-8b (default scenarios then 1, 2, 5, plus table 1b: the step vs its memory bound)",
    )
    ap.add_argument("--tiny", action="store_true", help="with --synthetic: the shape's 2-layer variant (CPU tests)")
    ap.add_argument(
        "--synthetic-dtype", choices=["f16", "bf16", "q8_0"], default="f16", help="matrix type of --synthetic"
    )
    ap.add_argument(
        "--synthetic-dir",
        metavar="DIR",
        help="where --synthetic models and adapters are cached (default $LORAPLANE_CACHE/synthetic, "
        "$LORAPLANE_CACHE defaulting to ~/.cache/loraplane)",
    )
    ap.add_argument(
        "--distinct",
        metavar="LIST",
        default="16",
        help="with --synthetic: distinct-adapter counts of table 1b, each at the batches >= it (default 16)",
    )
    ap.add_argument(
        "--only",
        metavar="LIST",
        help="comma-separated scenarios to run: 1-9 or " + ", ".join(SCENARIOS.values()) + " (default: all)",
    )
    ap.add_argument("--reps", type=int, help="repetitions per figure (overrides the profile)")
    ap.add_argument("--requests", type=int, help="requests per serving run")
    ap.add_argument("--max-tokens", type=int, help="output tokens per serving request")
    ap.add_argument("--ks", metavar="LIST", help="adapter counts for serving, e.g. 0,1,4,16")
    ap.add_argument("--single-requests", type=int, help="requests of the 1-stream serving row (0: no such row)")
    ap.add_argument(
        "--longprompt-requests", type=int, help="requests per run of the long-prompt scenario (default: the profile's)"
    )
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--work-dir", metavar="DIR", help="where adapters, data dirs and logs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (server logs) afterwards")
    ap.add_argument("--plain", action="store_true", help="plain-text tables even when rich is installed")
    ap.add_argument(
        "--paging-prefix-cache",
        choices=["keyed", "llama"],
        default="keyed",
        help="prefix cache policy of the paging scenario's workers (default keyed, the worker's "
        "default; llama keeps no cross-request store, which isolates the pool's memory)",
    )
    ap.add_argument(
        "--omp-wait-policy",
        choices=["inherit", "passive", "active"],
        default="inherit",
        help="OMP_WAIT_POLICY for this process and every server it starts (default: inherit the "
        "environment; unset, the worker's own default PASSIVE applies, in-process too). "
        "passive keeps a shared machine usable (spinning OpenMP threads collapse when another "
        "process takes a core); active spins",
    )
    return ap


def _synthetic_args(args: argparse.Namespace) -> tuple[int, ...]:
    """Check ``--synthetic``/``--tiny``/``--distinct``; returns the distinct-adapter counts.

    Raises:
        ValueError: an unknown shape, ``--tiny`` without ``--synthetic``, or a count < 2.
    """
    from bench.synthetic import SHAPES

    if args.synthetic and args.synthetic not in SHAPES:
        raise ValueError(f"--synthetic: unknown shape '{args.synthetic}' (expected one of {', '.join(SHAPES)})")
    if args.tiny and not args.synthetic:
        raise ValueError("--tiny needs --synthetic SHAPE")
    if args.synthetic and args.model:
        raise ValueError("--synthetic and --model name two base models: give one")
    distinct = tuple(int(n) for n in args.distinct.split(",") if n.strip())
    if any(n < 2 for n in distinct):
        raise ValueError("--distinct: counts of distinct adapters must be >= 2")
    return distinct


def _selected(only: str | None) -> list[str]:
    if not only:
        return list(SCENARIOS.values())
    out = []
    for item in only.split(","):
        item = item.strip()
        name = SCENARIOS.get(item, item)
        if name not in SCENARIOS.values():
            raise ValueError(f"--only: unknown scenario '{item}' (expected 1-9 or {', '.join(SCENARIOS.values())})")
        out.append(name)
    return out


def _have_rich() -> bool:
    from importlib.util import find_spec

    return find_spec("rich") is not None


def _load_avg() -> str:
    from bench.machine import load_avg

    return load_avg()


class _Log:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _install_signal_handlers() -> None:
    """SIGTERM (and SIGINT, which a background job may have inherited as ignored) raise
    KeyboardInterrupt, so the ``finally`` blocks stop every server this run started."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGINT, _interrupt)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, selected, ks, distinct = _parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    except ValueError as exc:
        print(f"loraplane bench: {exc}", file=sys.stderr)
        return 2

    _install_signal_handlers()
    if args.omp_wait_policy != "inherit":
        # read by the OpenMP runtime when torch loads: set before the import; the servers
        # started later inherit it through the environment
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    import torch  # noqa: F401 - torch loads here, after OMP_WAIT_POLICY is set

    import worker  # noqa: F401 - sets the worker's default OMP_WAIT_POLICY (PASSIVE) before torch loads

    name, profile = _profile(args, ks)
    log = _Log()
    use_rich = _have_rich() and not args.plain
    run_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="loraplane-bench-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    llama_server = os.environ.get("LLAMA_SERVER") or None
    result = _new_result(args, argv, name, profile, selected, distinct, llama_server)
    log(f"profile {name}: {json.dumps(profile.to_json())}")
    log(f"machine: {json.dumps(result['machine'])}")
    log(f"work dir {run_dir}" + (f"; llama-server peer {llama_server}" if llama_server else ""))
    t_start = time.monotonic()
    record = _Recorder(result, log, use_rich=use_rich)

    interrupted = False
    try:
        run_scenarios(args, profile, selected, run_dir, llama_server, result, record, log, distinct)
    except KeyboardInterrupt:
        interrupted = True
        result["errors"].append({"scenario": "-", "error": "interrupted"})
        log("interrupted: servers stopped, partial results kept")
    finally:
        _finish(args, result, run_dir, t_start, log)
    if interrupted:
        return 130
    log(
        f"done in {result['duration_s']:.0f}s"
        + (f" with {len(result['errors'])} failed scenario(s)" if result["errors"] else "")
    )
    return 1 if result["errors"] else 0


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], tuple[int, ...] | None, tuple[int, ...]]:
    """The command line, checked: ``(args, selected scenarios, --ks counts or None, --distinct
    counts)``; ``--synthetic`` without ``--only`` selects scenarios 1, 2 and 5.

    Raises:
        SystemExit: ``--help``, or a usage error argparse found (and printed).
        ValueError: an unknown ``--only`` scenario, a negative ``--ks`` count, or a
            `_synthetic_args` error.
    """
    args = _parser().parse_args(argv)
    selected = _selected(args.only)
    ks = tuple(int(k) for k in args.ks.split(",")) if args.ks else None
    if ks is not None and any(k < 0 for k in ks):
        raise ValueError("--ks: adapter counts must be >= 0")
    distinct = _synthetic_args(args)
    if args.synthetic and not args.only:
        selected = ["engine", "serving", "roofline"]
    return args, selected, ks, distinct


def _profile(args: argparse.Namespace, ks: tuple[int, ...] | None) -> tuple[str, Profile]:
    """The profile's name (smoke, quick or full) and the profile with the command line's
    overrides; under ``--synthetic`` the GPU step's batches and, on CUDA, a 1 GiB copy."""
    import torch

    from bench.profiles import PROFILES, with_overrides

    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    profile = with_overrides(
        PROFILES[name],
        reps=args.reps,
        requests=args.requests,
        max_tokens=args.max_tokens,
        ks=ks,
        single_requests=args.single_requests,
        longprompt_requests=args.longprompt_requests,
    )
    if args.synthetic:
        # the batch sizes; a 1 GiB copy for the rate the GPU step is compared with
        on_cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
        profile = with_overrides(profile, decode_batches=SYNTHETIC_BATCHES, bw_mib=1024 if on_cuda else None)
    return name, profile


def _new_result(
    args: argparse.Namespace,
    argv: list[str],
    name: str,
    profile: Profile,
    selected: list[str],
    distinct: tuple[int, ...],
    llama_server: str | None,
) -> dict:
    """The results JSON before any scenario ran: the command, its parameters, the machine."""
    import torch

    from bench.machine import machine_info

    return {
        "bench": "loraplane",
        "version": 1,
        "profile": name,
        "seed": args.seed,
        "command": "loraplane bench " + " ".join(argv),
        "selected": selected,
        "params": profile.to_json()
        | {
            "dtype": args.dtype,
            "device": args.device,
            "weights": args.weights,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "synthetic": args.synthetic,
            "tiny": args.tiny,
            "synthetic_dtype": args.synthetic_dtype if args.synthetic else None,
            "distinct": list(distinct),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            **machine_info(args.weights, args.device, args.dtype),
            "load_avg_start": _load_avg(),
        },
        "llama_server": llama_server,
        "scenarios": {},
        "errors": [],
    }


class _Recorder:
    """``record(key, fn)``: runs one scenario, keeps what ``fn`` returns under
    ``result["scenarios"][key]`` (with the load average before and after), or its error there
    and in ``result["errors"]``, and prints its table(s) at once."""

    def __init__(self, result: dict, log: Callable[[str], None], *, use_rich: bool) -> None:
        self.result = result
        self.log = log
        self.use_rich = use_rich

    def __call__(self, key: str, fn: Callable[[], dict]) -> None:
        from bench.report import print_section, sections_for

        scenarios = self.result["scenarios"]
        load_before = _load_avg()
        try:
            scenarios[key] = fn()
            scenarios[key].setdefault("load_avg", {"before": load_before, "after": _load_avg()})
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - one failed scenario must not hide the others
            msg = f"{type(exc).__name__}: {exc}"
            self.log(f"{key} FAILED: {msg}")
            traceback.print_exc(file=sys.stderr)
            scenarios[key] = {"error": msg}
            self.result["errors"].append({"scenario": key, "error": msg})
        for s in sections_for(key, scenarios[key], self.result["machine"]):
            print_section(s, use_rich=self.use_rich)
        sys.stdout.flush()


def _finish(args: argparse.Namespace, result: dict, run_dir: Path, t_start: float, log: Callable[[str], None]) -> None:
    """Close the run, also after an error or an interrupt: duration and end load average into
    ``result``, ``--json`` and ``--markdown`` written, the temporary work dir removed."""
    from bench.report import render_markdown

    result["duration_s"] = round(time.monotonic() - t_start, 1)
    result["machine"]["load_avg_end"] = _load_avg()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(_clean(result), indent=1) + "\n")
        log(f"wrote {args.json_out}")
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(result))
        log(f"wrote {args.markdown}")
    if not args.keep and not args.work_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


def _clean(o):
    """JSON-ready copy: non-finite floats become null (strict JSON has no NaN)."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if o is None or isinstance(o, (str, int, bool)):
        return o
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
