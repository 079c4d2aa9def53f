"""The scenarios of ``loraplane bench`` run in order on one base model (`run_scenarios`; the
command line, the results JSON and the tables are ``bench.__main__``'s).

1. the in-process ones (scenario 1, table 1b under ``--synthetic``, and the in-process halves
   of 5 and 9) on the model loaded here, which is then freed;
2. the serving ones (2, 4, 3, 6, 7, 8), each on servers of its own;
3. the tables that combine both: 5 and 9 completed with scenario 2's figures.

Torch and the worker are imported inside the functions: ``bench.__main__`` imports
this module before it sets ``OMP_WAIT_POLICY``, which must precede torch's loading.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from bench.machine import load_avg

if TYPE_CHECKING:
    from bench.profiles import Profile
    from bench.serving import ServingContext
    from bench.synthetic import SyntheticModel
    from worker.runtime.model import LoadedModel

Record = Callable[[str, Callable[[], dict]], None]
"""``record(key, fn)``: runs ``fn``, keeps its figures (or its error) under ``key`` and prints its
table(s)."""
IN_PROCESS = ("engine", "roofline", "bounds")
"""Scenarios that load the base model in this process."""
SERVING_LIKE = ("serving", "prefix", "lifecycle", "paging", "longprompt", "longctx")
"""Scenarios that start servers."""


class _BaseFacts(NamedTuple):
    """What the adapters and prompts need to know of the base model."""

    arch: str
    tensors: dict[str, tuple[int, ...]]  # tensor name → ggml ne
    n_vocab: int
    bos: int | None  # None: the model adds no BOS


def run_scenarios(
    args: argparse.Namespace,
    profile: Profile,
    selected: list[str],
    run_dir: Path,
    llama_server: str | None,
    result: dict,
    record: Record,
    log: Callable[[str], None],
    distinct: tuple[int, ...],
) -> None:
    """Every scenario of ``selected`` in the order of the module docstring, each handed to
    ``record`` (which keeps its figures or its error in ``result``).

    ``args`` is ``loraplane bench``'s parsed command line; ``run_dir`` holds adapters, data dirs
    and server logs; ``llama_server`` is the peer binary or None; ``distinct`` the
    distinct-adapter counts of table 1b. A scenario's failure is recorded under its key, not
    raised; ``KeyboardInterrupt`` (SIGTERM/SIGINT) passes through once the servers are stopped.

    Raises:
        Exception: whatever writing (``--synthetic``), reading or loading the base model raises,
            before any scenario ran.
    """
    from bench.synth import AdapterFactory

    synthetic = _synthetic_model(args, result, log) if args.synthetic else None
    if synthetic is not None:
        model_path = str(synthetic.path)
    else:
        from worker.runtime.model import default_model_path

        model_path = str(Path(args.model).resolve()) if args.model else str(default_model_path())
    base, facts = _base_model(args, model_path, selected, log)
    if synthetic is not None:  # rank-16 F16 adapters cached beside the model
        factory = synthetic.factory
    else:
        factory = AdapterFactory(run_dir / "adapters", arch=facts.arch, base_tensors=facts.tensors, base_seed=args.seed)
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

    if any(s in selected for s in SERVING_LIKE):
        from bench.engine import token_hi
        from bench.serving import ServingContext

        sc = ServingContext(
            profile=profile,
            seed=args.seed,
            run_dir=run_dir,
            factory=factory,
            dtype=args.dtype,
            device=args.device,
            bos=facts.bos,
            token_hi=token_hi(facts.n_vocab),
            model_path=model_path,
            llama_server=llama_server,
            log=log,
            weights=args.weights,
            paging_prefix_cache=args.paging_prefix_cache,
        )
        _serving_scenarios(sc, selected, result, record, facts)
    _combined_scenarios(selected, roofline_part, bounds_part, result, record)


def _synthetic_model(args: argparse.Namespace, result: dict, log: Callable[[str], None]) -> SyntheticModel:
    """The ``--synthetic`` model, written once into its cache folder; its path and the time the
    writing took go into ``result["params"]``."""
    from bench.synthetic import ensure_model, shape_summary

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
    return synthetic


def _base_model(
    args: argparse.Namespace, model_path: str, selected: list[str], log: Callable[[str], None]
) -> tuple[LoadedModel | None, _BaseFacts]:
    """The base model loaded in this process when an `IN_PROCESS` scenario is selected, else
    None (only the GGUF's metadata and vocabulary are read); and its `_BaseFacts`."""
    if any(s in selected for s in IN_PROCESS):
        from worker.runtime.model import load_model

        log(f"loading {model_path} in-process ({args.dtype}, {args.device}, weights {args.weights})")
        base = load_model(model_path, dtype=args.dtype, device=args.device, weights=args.weights)
        bos = base.tokenizer.bos_id if base.tokenizer.add_bos else None
        return base, _BaseFacts(base.arch, base.tensor_ne, base.n_vocab, bos)
    from loraplane.formats.gguf.reader import read_gguf
    from loraplane.formats.tokenizer import Tokenizer

    gf = read_gguf(model_path)
    tok = Tokenizer.from_gguf(gf)
    tensors = {n: tuple(r.ne) for n, r in gf.tensors.items()}
    return None, _BaseFacts(gf.arch, tensors, tok.n_vocab, tok.bos_id if tok.add_bos else None)


def _serving_scenarios(
    sc: ServingContext,
    selected: list[str],
    result: dict,
    record: Record,
    facts: _BaseFacts,
) -> None:
    """Scenarios 2, 4, 3, 6, 7 and 8 (those selected), each on its own servers; scenario 4 runs
    on scenario 2's mixed worker when both are selected."""
    from bench.serving import run_multitenant, run_prefix

    profile, factory, log = sc.profile, sc.factory, sc.log
    if "serving" in selected:
        lifecycle_hook = _lifecycle_hook(factory, profile, sc.bos, log) if "lifecycle" in selected else None
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
        record("lifecycle", lambda: _lifecycle_alone(sc, factory, profile, sc.bos, log))
    if "prefix" in selected:
        record("prefix", lambda: run_prefix(sc))
    if "paging" in selected:
        from bench.paging import run_paging

        record("paging", lambda: run_paging(sc, facts.arch, facts.tensors, log))
    if "longprompt" in selected or "longctx" in selected:
        from bench.longcontext import run_long

        try:
            long_out: dict = run_long(sc, selected)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - the servers failed: both scenarios report it
            traceback.print_exc(file=sys.stderr)
            long_out = {"longprompt": exc, "longctx": exc}
        for key in ("longprompt", "longctx"):
            if key in selected:
                record(key, partial(_unwrap, long_out.get(key)))


def _combined_scenarios(
    selected: list[str],
    roofline_part: dict,
    bounds_part: dict,
    result: dict,
    record: Record,
) -> None:
    """Scenarios 5 and 9 (those selected): their in-process halves (``{"value": ...}`` or
    ``{"error": exc}``, `_deferred`) completed with the serving scenario's figures."""
    if "roofline" in selected:
        from bench.roofline import add_serving

        def roofline() -> dict:
            if "error" in roofline_part:
                raise roofline_part["error"]
            return add_serving(roofline_part["value"], result["scenarios"].get("serving"))

        record("roofline", roofline)
    if "bounds" in selected:
        from bench.bounds import add_served_step

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
    """Table 1b on the loaded model (`bench.device_step`)."""
    from bench.device_step import COPY_MIB_CUDA, run_device_step
    from bench.engine import measure_bandwidth

    mib = COPY_MIB_CUDA if base.device.type == "cuda" else profile.bw_mib
    bw = measure_bandwidth(mib, max(9, profile.reps), base.device)
    log(f"step: copy rate {bw['gb_s']['median']:.1f} GB/s ({mib} MiB device-to-device copy)")
    out = run_device_step(base, factory, profile, distinct=distinct, seed=args.seed, bandwidth=bw, log=log)
    if base.device.type == "cuda":
        import torch

        out["gpu"] = torch.cuda.get_device_name(base.device)
    return out


def _bounds_in_process(base, profile, engine_adapter, args, log) -> dict:
    from bench.bounds import run_bounds

    return run_bounds(base, engine_adapter, profile, seed=args.seed, log=log)


def _in_process_scenarios(
    base: LoadedModel,
    profile: Profile,
    selected: list[str],
    engine_adapter: Path,
    result: dict,
    args: argparse.Namespace,
    record: Record,
    log: Callable[[str], None],
) -> dict:
    """Scenario 1 (recorded) and scenario 5's in-process half on the loaded model; returns
    ``{"value": ...}`` or ``{"error": exc}`` for the roofline (``{}`` when it is not selected)."""
    if "engine" in selected:
        from bench.engine import run_engine
        from bench.profiles import with_overrides

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
    from bench.engine import measure_bandwidth
    from bench.roofline import run_roofline

    bw = measure_bandwidth(profile.bw_mib, max(9, profile.reps), base.device)
    log(f"roofline: copy bandwidth {bw['gb_s']['median']:.1f} GB/s")
    engine = result["scenarios"].get("engine")
    if not engine or "error" in engine:
        from bench.engine import run_engine
        from bench.profiles import with_overrides

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
    from bench.lifecycle import run_lifecycle

    def hook(srv):
        try:
            before = load_avg()
            out = run_lifecycle(srv, factory, profile, bos=bos, log=log)
            out["load_avg"] = {"before": before, "after": load_avg()}
            return out
        except Exception as exc:  # noqa: BLE001 - reported under "lifecycle"
            traceback.print_exc(file=sys.stderr)
            return RuntimeError(f"{type(exc).__name__}: {exc}")

    return hook


def _lifecycle_alone(sc, factory, profile, bos, log) -> dict:
    from bench.lifecycle import run_lifecycle
    from bench.servers import LoraplaneServers, start_all

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
