"""Scenario 4: adapter lifecycle on a running control plane + worker.

- register → first token: ``RegisterAdapter`` (upload, validation, synchronous push to the
  worker) then a 1-token ``Generate`` with that adapter; ms from the register call to the
  first token at the client. Timed for the first ``lifecycle_samples`` new adapters.
- worker cold load: ``LoadAdapter`` sent straight to the worker (bytes streamed in 1 MiB
  chunks, as the control plane pushes them) for adapters it has never seen, then unloaded;
  ms per adapter and per MiB of adapter file.
- resident bytes: worker RSS and the worker's own ``adapter_bytes`` (A/B tensors, which live
  on the model's device) before and after registering ``lifecycle_adapters`` adapters; the
  difference per adapter, and how many adapters fit in 16 GiB at that rate.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from bench.engine import with_bos
from bench.profiles import Profile
from bench.servers import LoraplaneServers
from bench.stats import Figure
from bench.synth import AdapterFactory
from clients.results import TokenEvent
from loraplane.limits import CHUNK_BYTES
from loraplane.v1 import common_pb2

GIB16 = 16 * (1 << 30)
REGISTER_BASE = 100  # synthetic adapter numbers used here (distinct from scenarios 2/3)
COLD_BASE = 400
DIRECT_ID_BASE = 1_000_000  # ids for direct worker loads: never assigned by the control plane


def _chunks(adapter_id: int, sha: str, data: bytes):
    for off in range(0, len(data), CHUNK_BYTES):
        piece = data[off : off + CHUNK_BYTES]
        yield (
            common_pb2.AdapterChunk(id=adapter_id, sha256=sha, data=piece)
            if off == 0
            else common_pb2.AdapterChunk(data=piece)
        )


def run_lifecycle(
    srv: LoraplaneServers, factory: AdapterFactory, profile: Profile, *, bos: int | None, log: Callable[[str], None]
) -> dict:
    """Scenario 4 (see the module docstring) on ``srv``, which is started and ready."""
    p = profile
    n = p.lifecycle_adapters
    samples = min(p.lifecycle_samples, n)
    paths = factory.paths(n, start=REGISTER_BASE)
    cold_paths = factory.paths(max(3, samples), start=COLD_BASE)
    file_bytes = paths[0].stat().st_size
    client = srv.client
    prompt = with_bos(bos, [1000 + 7 * i for i in range(7)])
    # warm the generate path (not timed)
    client.generate(prompt_tokens=prompt, adapters={}, max_tokens=1, ignore_eos=True)
    st0, rss0, cp0 = srv.stats(), srv.worker_rss(), srv.cp_rss()
    anon0, cp_anon0 = srv.worker_rss("RssAnon"), srv.cp_rss("RssAnon")
    register_ms, first_token_ms, ttft_ms = [], [], []
    for j, path in enumerate(paths):
        t0 = time.perf_counter()
        info = client.add_adapter(path)
        t1 = time.perf_counter()
        register_ms.append((t1 - t0) * 1e3)
        if j < samples:
            t2 = None
            for ev in client.generate_stream(
                prompt_tokens=prompt, adapters={info.id: 1.0}, max_tokens=1, ignore_eos=True
            ):
                if isinstance(ev, TokenEvent) and t2 is None:
                    t2 = time.perf_counter()
            if t2 is None:
                raise RuntimeError(
                    f"lifecycle: the 1-token request with adapter {info.id} ({path.name}) streamed no token"
                )
            first_token_ms.append((t2 - t0) * 1e3)
            ttft_ms.append((t2 - t1) * 1e3)
            log(
                f"lifecycle: adapter {j + 1}: register {register_ms[-1]:.0f} ms, first token after "
                f"{first_token_ms[-1]:.0f} ms"
            )
        elif (j + 1) % 16 == 0:
            log(f"lifecycle: {j + 1}/{n} adapters registered")
    st1, rss1, cp1 = srv.stats(), srv.worker_rss(), srv.cp_rss()
    anon1, cp_anon1 = srv.worker_rss("RssAnon"), srv.cp_rss("RssAnon")
    cold_ms = []
    for i, path in enumerate(cold_paths):
        data = path.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        aid = DIRECT_ID_BASE + i
        t0 = time.perf_counter()
        srv.worker_stub.LoadAdapter(_chunks(aid, sha, data), timeout=300)
        cold_ms.append((time.perf_counter() - t0) * 1e3)
        srv.worker_stub.UnloadAdapter(common_pb2.AdapterRef(id=aid), timeout=300)
    log(f"lifecycle: worker cold load {sorted(cold_ms)[len(cold_ms) // 2]:.0f} ms per adapter")
    mib = file_bytes / (1 << 20)
    # Registrations are not pushed: only the sampled adapters (one request each)
    # reached the worker, so per-adapter memory is over those it holds, not over registrations.
    held = max(1, st1.host_adapters - st0.host_adapters)
    device_per = (st1.adapter_bytes - st0.adapter_bytes) / held
    host_per = (rss1 - rss0) / held
    cp_per = (cp1 - cp0) / n
    return {
        "adapters_registered": n,
        "timed": samples,
        "rank": factory.rank,
        "pairs": factory.n_pairs,
        "file_bytes": file_bytes,
        "register_ms": Figure.of(register_ms, "ms").to_json(),
        "register_to_first_token_ms": Figure.of(first_token_ms, "ms").to_json(),
        "first_token_after_register_ms": Figure.of(ttft_ms, "ms").to_json(),
        "worker_cold_load_ms": Figure.of(cold_ms, "ms").to_json(),
        "worker_cold_load_ms_per_mib": Figure.of([c / mib for c in cold_ms], "ms/MiB").to_json(),
        "adapters_held_by_worker": st1.host_adapters - st0.host_adapters,
        "device_bytes_per_adapter": device_per,
        "host_rss_bytes_per_adapter": host_per,
        "host_anon_bytes_per_adapter": (anon1 - anon0) / n,
        "control_plane_rss_bytes_per_adapter": cp_per,
        "control_plane_anon_bytes_per_adapter": (cp_anon1 - cp_anon0) / n,
        "worker_rss_before": rss0,
        "worker_rss_after": rss1,
        "fit_16gib_device": int(GIB16 // device_per) if device_per > 0 else None,
        "fit_16gib_host": int(GIB16 // host_per) if host_per > 0 else None,
        "device": srv.flags["device"],
        "dtype": srv.flags["dtype"],
        "registered_total": len(client.list_adapters()),
        "resident_on_worker": len(st1.adapter_ids),
    }
