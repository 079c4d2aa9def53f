"""``python -m loraplane.bench [--quick | --smoke] [--json OUT]`` (also ``loraplane bench``).

Runs, in one process and one go:

1. engine: in-process prompt processing and decode (B = 1, 8, 32), base vs one rank-8 adapter;
2. multi-tenant serving over gRPC, mixed vs compat batching, K = 0, 1, 4, 16 adapters;
3. prefix reuse under ``--prefix-cache keyed`` vs ``llama``;
4. adapter lifecycle: register → first token, worker cold load, resident bytes per adapter;
5. the memory roofline of a decode step;
6. adapter paging (many adapters vs a few that fit);
7. long prompts (distinct ~1 500-token prompts, 8 streams, K = 0 and 16);
8. long-context decode: inter-token latency at ~3 000 vs ~100 tokens of context;
9. the compute (peak int8 MAC rate) and memory bounds of a B=16 decode step vs the step.

``--synthetic qwen2.5-1.5b|llama-3-8b`` writes a random-weight GGUF of that real shape (and
rank-16 adapters) into a cache folder once (`loraplane.bench.synthetic`), runs scenarios 1, 2
and 5 on it unless ``--only`` says otherwise, and adds table 1b (`loraplane.bench.device_step`):
the decode step at B = 1, 16, 64 with 0, 1 and 16 distinct adapters against its memory bound,
host time, kernel launches and GPU busy time per step. ``--tiny`` shrinks the shape for a CPU.

Each scenario prints its table as soon as it finishes; ``--json OUT`` writes every figure
(median, min, max, n) and ``--markdown OUT`` the tables for ``bench/RESULTS.md``. With
``$LLAMA_SERVER`` naming a llama-server binary, scenarios 2, 3, 7 and 8 also run against it.
Progress goes to stderr. Exit code 0 when every scenario ran, 1 when one failed (its error
is in the table and the JSON), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import gc
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

from loraplane.compute_spec import DEVICE_METAVAR, DTYPE_NAMES, check_device_spec

if TYPE_CHECKING:  # the real imports are lazy: torch must load after OMP_WAIT_POLICY is set
    from loraplane.bench.profiles import Profile
    from loraplane.worker.runtime.model import LoadedModel

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
    from loraplane.bench.synthetic import SHAPES

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
    from loraplane.bench.machine import load_avg

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
    ap = _parser()
    try:
        args = ap.parse_args(argv)
        selected = _selected(args.only)
        ks = tuple(int(k) for k in args.ks.split(",")) if args.ks else None
        if ks is not None and any(k < 0 for k in ks):
            raise ValueError("--ks: adapter counts must be >= 0")
        distinct = _synthetic_args(args)
        if args.synthetic and not args.only:
            selected = ["engine", "serving", "roofline"]
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
    import torch

    import loraplane.worker  # noqa: F401 - sets the worker's default OMP_WAIT_POLICY (PASSIVE) before torch loads
    from loraplane.bench.machine import machine_info
    from loraplane.bench.profiles import PROFILES, with_overrides
    from loraplane.bench.report import print_section, render_markdown, sections_for

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
    log = _Log()
    use_rich = _have_rich() and not args.plain
    run_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="loraplane-bench-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    llama_server = os.environ.get("LLAMA_SERVER") or None
    result: dict = {
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
    log(f"profile {name}: {json.dumps(profile.to_json())}")
    log(f"machine: {json.dumps(result['machine'])}")
    log(f"work dir {run_dir}" + (f"; llama-server peer {llama_server}" if llama_server else ""))
    t_start = time.monotonic()

    def record(key: str, fn) -> None:
        load_before = _load_avg()
        try:
            result["scenarios"][key] = fn()
            result["scenarios"][key].setdefault("load_avg", {"before": load_before, "after": _load_avg()})
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - one failed scenario must not hide the others
            msg = f"{type(exc).__name__}: {exc}"
            log(f"{key} FAILED: {msg}")
            traceback.print_exc(file=sys.stderr)
            result["scenarios"][key] = {"error": msg}
            result["errors"].append({"scenario": key, "error": msg})
        for s in sections_for(key, result["scenarios"][key], result["machine"]):
            print_section(s, use_rich=use_rich)
        sys.stdout.flush()

    interrupted = False
    try:
        _run(args, profile, selected, run_dir, llama_server, result, record, log, distinct)
    except KeyboardInterrupt:
        interrupted = True
        result["errors"].append({"scenario": "-", "error": "interrupted"})
        log("interrupted: servers stopped, partial results kept")
    finally:
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
    if interrupted:
        return 130
    log(
        f"done in {result['duration_s']:.0f}s"
        + (f" with {len(result['errors'])} failed scenario(s)" if result["errors"] else "")
    )
    return 1 if result["errors"] else 0


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


def _run(args, profile, selected, run_dir: Path, llama_server, result, record, log, distinct) -> None:
    from loraplane.bench.synth import AdapterFactory
    from loraplane.worker.runtime.model import default_model_path

    synthetic = None
    if args.synthetic:
        from loraplane.bench.synthetic import ensure_model, shape_summary

        log(shape_summary(args.synthetic, tiny=args.tiny, dtype=args.synthetic_dtype))
        t0 = time.monotonic()
        synthetic = ensure_model(
            args.synthetic,
            tiny=args.tiny,
            dtype=args.synthetic_dtype,
            seed=args.seed,
            cache_dir=args.synthetic_dir,
            log=log,
        )
        result["params"]["synthetic_path"] = str(synthetic.path)
        result["params"]["synthetic_write_s"] = round(time.monotonic() - t0, 1)
        model_path = str(synthetic.path)
    else:
        model_path = str(Path(args.model).resolve()) if args.model else str(default_model_path())
    in_process = "engine" in selected or "roofline" in selected or "bounds" in selected
    base: LoadedModel | None = None
    if in_process:
        from loraplane.worker.runtime.model import load_model

        log(f"loading {model_path} in-process ({args.dtype}, {args.device}, weights {args.weights})")
        base = load_model(model_path, dtype=args.dtype, device=args.device, weights=args.weights)
        arch, tensors, n_vocab = base.arch, base.tensor_ne, base.n_vocab
        bos = base.tokenizer.bos_id if base.tokenizer.add_bos else None
    else:
        from loraplane.worker.gguf.reader import read_gguf

        gf = read_gguf(model_path)
        arch, tensors = gf.arch, {n: tuple(r.ne) for n, r in gf.tensors.items()}
        from loraplane.worker.runtime.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(gf)
        bos, n_vocab = (tok.bos_id if tok.add_bos else None), tok.n_vocab
    if synthetic is not None:  # rank-16 F16 adapters cached beside the model
        factory = synthetic.factory
    else:
        factory = AdapterFactory(run_dir / "adapters", arch=arch, base_tensors=tensors, base_seed=args.seed)
    engine_adapter = factory.path(0)

    roofline_part: dict = {}
    bounds_part: dict = {}
    if base is not None:  # loaded exactly when "engine", "roofline" or "bounds" is selected
        roofline_part = _in_process_scenarios(base, profile, selected, engine_adapter, result, args, record, log)
        if synthetic is not None and "engine" in selected:
            record("step", lambda: _device_step(base, factory, profile, distinct, args, log))
        if "bounds" in selected:
            bounds_part = _deferred(lambda: _bounds_in_process(base, profile, engine_adapter, args, log))
        del base
        gc.collect()

    serving_like = ("serving", "prefix", "lifecycle", "paging", "longprompt", "longctx")
    if any(s in selected for s in serving_like):
        from loraplane.bench.engine import token_hi
        from loraplane.bench.serving import ServingContext, run_multitenant, run_prefix

        sc = ServingContext(
            profile=profile,
            seed=args.seed,
            run_dir=run_dir,
            factory=factory,
            dtype=args.dtype,
            device=args.device,
            bos=bos,
            token_hi=token_hi(n_vocab),
            model_path=model_path,
            llama_server=llama_server,
            log=log,
            weights=args.weights,
            paging_prefix_cache=args.paging_prefix_cache,
        )
        if "serving" in selected:
            lifecycle_hook = _lifecycle_hook(factory, profile, bos, log) if "lifecycle" in selected else None
            holder: dict = {}

            def serving() -> dict:
                out, lc = run_multitenant(sc, lifecycle_hook)
                holder["lifecycle"] = lc
                eng = result["scenarios"].get("engine") or {}
                step = eng.get("variants", {}).get("base", {}).get("decode", {}).get(str(profile.streams), {})
                if "step_sampled_ms" in step:  # scenario 1's in-process step at B = streams
                    out["engine_step_sampled_ms"] = step["step_sampled_ms"]
                return out

            record("serving", serving)
            if "lifecycle" in selected:
                lc = holder.get("lifecycle")
                record("lifecycle", lambda: _unwrap(lc))
        elif "lifecycle" in selected:
            record("lifecycle", lambda: _lifecycle_alone(sc, factory, profile, bos, log))
        if "prefix" in selected:
            record("prefix", lambda: run_prefix(sc))
        if "paging" in selected:
            from loraplane.bench.paging import run_paging

            record("paging", lambda: run_paging(sc, arch, tensors, log))
        if "longprompt" in selected or "longctx" in selected:
            from loraplane.bench.longcontext import run_long

            try:
                long_out: dict = run_long(sc, selected)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - the servers failed: both scenarios report it
                traceback.print_exc(file=sys.stderr)
                long_out = {"longprompt": exc, "longctx": exc}
            for key in ("longprompt", "longctx"):
                if key in selected:
                    record(key, lambda key=key: _unwrap(long_out.get(key)))
    if "roofline" in selected:
        from loraplane.bench.roofline import add_serving

        def roofline() -> dict:
            if "error" in roofline_part:
                raise roofline_part["error"]
            return add_serving(roofline_part["value"], result["scenarios"].get("serving"))

        record("roofline", roofline)
    if "bounds" in selected:
        from loraplane.bench.bounds import add_served_step

        def bounds() -> dict:
            if "error" in bounds_part:
                raise bounds_part["error"]
            return add_served_step(bounds_part["value"], result["scenarios"].get("serving"))

        record("bounds", bounds)


def _deferred(fn: Callable[[], dict]) -> dict:
    """``{"value": fn()}``, or ``{"error": exc}`` (printed) — for an in-process part whose table
    is recorded later, after the serving scenarios."""
    try:
        return {"value": fn()}
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - reported under its scenario when recorded
        traceback.print_exc(file=sys.stderr)
        return {"error": exc}


def _device_step(base, factory, profile, distinct, args, log) -> dict:
    """Table 1b on the loaded model (`loraplane.bench.device_step`)."""
    from loraplane.bench.device_step import COPY_MIB_CUDA, run_device_step
    from loraplane.bench.engine import measure_bandwidth

    mib = COPY_MIB_CUDA if base.device.type == "cuda" else profile.bw_mib
    bw = measure_bandwidth(mib, max(9, profile.reps), base.device)
    log(f"step: copy rate {bw['gb_s']['median']:.1f} GB/s ({mib} MiB device-to-device copy)")
    out = run_device_step(base, factory, profile, distinct=distinct, seed=args.seed, bandwidth=bw, log=log)
    if base.device.type == "cuda":
        import torch

        out["gpu"] = torch.cuda.get_device_name(base.device)
    return out


def _bounds_in_process(base, profile, engine_adapter, args, log) -> dict:
    from loraplane.bench.bounds import run_bounds

    return run_bounds(base, engine_adapter, profile, seed=args.seed, log=log)


def _in_process_scenarios(
    base: LoadedModel,
    profile: Profile,
    selected: list[str],
    engine_adapter: Path,
    result: dict,
    args: argparse.Namespace,
    record: Callable[[str, Callable[[], dict]], None],
    log: Callable[[str], None],
) -> dict:
    """Scenario 1 (recorded) and scenario 5's in-process half on the loaded model; returns
    ``{"value": ...}`` or ``{"error": exc}`` for the roofline (``{}`` when it is not selected)."""
    if "engine" in selected:
        from loraplane.bench.engine import run_engine
        from loraplane.bench.profiles import with_overrides

        # B = streams too: the in-process step table 2c puts beside the worker's step interval
        batches = tuple(sorted({*profile.decode_batches, profile.streams}))
        eng_profile = with_overrides(profile, decode_batches=batches)
        record("engine", lambda: run_engine(base, engine_adapter, eng_profile, seed=args.seed, log=log))
    roofline_part: dict = {}
    if "roofline" in selected:
        # the in-process half now (it needs the loaded model); the table is recorded after the
        # serving scenario, which adds the worker's RSS and the 1-stream per-token times
        try:
            roofline_part["value"] = _roofline_in_process(base, profile, engine_adapter, result, args, log)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - reported under "roofline"
            traceback.print_exc(file=sys.stderr)
            roofline_part["error"] = exc
    return roofline_part


def _roofline_in_process(base, profile, engine_adapter, result, args, log) -> dict:
    """Scenario 5's in-process measurements: copy bandwidth, bytes, the B=1 decode step."""
    from loraplane.bench.engine import measure_bandwidth
    from loraplane.bench.roofline import run_roofline

    bw = measure_bandwidth(profile.bw_mib, max(9, profile.reps), base.device)
    log(f"roofline: copy bandwidth {bw['gb_s']['median']:.1f} GB/s")
    engine = result["scenarios"].get("engine")
    if not engine or "error" in engine:
        from loraplane.bench.engine import run_engine
        from loraplane.bench.profiles import with_overrides

        engine = run_engine(base, engine_adapter, with_overrides(profile, decode_batches=(1,)), seed=args.seed, log=log)
    return run_roofline(base, bw, engine, engine["adapter_bytes"])


def _unwrap(lc):
    if lc is None:
        raise RuntimeError("not run: the scenario that carries it failed before reaching it")
    if isinstance(lc, BaseException):
        raise lc
    return lc


def _lifecycle_hook(factory, profile, bos, log):
    """Run scenario 4 on scenario 2's mixed worker before it stops; an error is kept, not raised,
    so that scenario 2's results survive it."""
    from loraplane.bench.lifecycle import run_lifecycle

    def hook(srv):
        try:
            before = _load_avg()
            out = run_lifecycle(srv, factory, profile, bos=bos, log=log)
            out["load_avg"] = {"before": before, "after": _load_avg()}
            return out
        except Exception as exc:  # noqa: BLE001 - reported under "lifecycle"
            traceback.print_exc(file=sys.stderr)
            return RuntimeError(f"{type(exc).__name__}: {exc}")

    return hook


def _lifecycle_alone(sc, factory, profile, bos, log) -> dict:
    from loraplane.bench.lifecycle import run_lifecycle
    from loraplane.bench.servers import LoraplaneServers, start_all

    srv = LoraplaneServers(
        sc.run_dir,
        "lifecycle",
        slots=profile.slots,
        batching="mixed",
        prefix_cache="keyed",
        dtype=sc.dtype,
        device=sc.device,
        model_path=sc.model_path,
        weights=sc.weights,
    )
    log("lifecycle: starting control plane + worker")
    start_all([srv])
    try:
        return run_lifecycle(srv, factory, profile, bos=bos, log=log)
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
