"""An in-memory stand-in for the control plane, to test clients without a model.

It speaks the real ``loraplane.v1.ControlPlane`` service and records what it received, so
tests can check the wire (adapter map presence, upload chunks, metadata). Generation is a
deterministic toy: the prompt's tokens are its UTF-8 bytes after a BOS of 2, and token i of
the output is ``100 + i + 10 * (sum of adapter ids with a non-zero scale)``, whose text is
``"<t{id}>"``; ``max_tokens`` tokens, finish reason ``length``.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from loraplane.v1 import common_pb2, control_plane_pb2, control_plane_pb2_grpc

BOS = 2
_ADMIN = {"RegisterAdapter", "UnregisterAdapter", "SetDefaultAdapters"}


@dataclass
class Received:
    """What the fake saw (read by tests)."""

    generate: list[common_pb2.GenerateRequest] = field(default_factory=list)
    chunks: list[list[common_pb2.AdapterChunk]] = field(default_factory=list)
    metadata: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


def toy_prompt_tokens(req: common_pb2.GenerateRequest) -> list[int]:
    if req.WhichOneof("prompt") == "tokens":
        return list(req.tokens.ids)
    return [BOS] + list(req.text.encode())


class FakeControlPlane(control_plane_pb2_grpc.ControlPlaneServicer):
    def __init__(self, admin_token: str | None = None) -> None:
        self.admin_token = admin_token
        self.received = Received()
        self.adapters: dict[int, common_pb2.AdapterInfo] = {}
        self.default: dict[int, float] = {}
        self.next_id = 0
        self.lock = threading.Lock()

    # -- helpers -------------------------------------------------------------------------

    def _record(self, method: str, context: grpc.ServicerContext) -> None:
        md = [(k, v) for k, v in context.invocation_metadata() if isinstance(v, str)]
        self.received.metadata[method] = md
        if self.admin_token and method in _ADMIN:
            if ("authorization", f"Bearer {self.admin_token}") not in md:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} needs the admin token")

    def _resolve(self, req: common_pb2.GenerateRequest) -> dict[int, float]:
        if not req.HasField("adapters"):
            return dict(self.default)
        resolved = {}
        for e in req.adapters.entries:
            if e.id not in self.adapters:
                raise KeyError(e.id)
            resolved[e.id] = e.scale
        return resolved

    # -- admin ---------------------------------------------------------------------------

    def RegisterAdapter(self, request_iterator, context):
        chunks = list(request_iterator)
        self._record("RegisterAdapter", context)
        self.received.chunks.append(chunks)
        first = chunks[0]
        if first.server_path:
            try:
                with open(first.server_path, "rb") as f:
                    data = f.read()
            except OSError as err:
                context.abort(grpc.StatusCode.NOT_FOUND, f"server path {first.server_path}: {err}")
            path = first.server_path
        else:
            data = b"".join(c.data for c in chunks)
            path = f"uploads/{hashlib.sha256(data).hexdigest()}.gguf"
        if not data.startswith(b"GGUF"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{path}: not a GGUF file")
        sha = hashlib.sha256(data).hexdigest()
        with self.lock:
            for info in self.adapters.values():
                if info.sha256 == sha:
                    return info
            info = common_pb2.AdapterInfo(
                id=self.next_id, name=first.name or f"adapter{self.next_id}", path=path,
                sha256=sha, arch="gemma3", alpha=16.0, ranks=[8],
                target_tensors=["blk.0.attn_q.weight"], size_bytes=len(data), n_nodes=6)
            self.adapters[self.next_id] = info
            self.next_id += 1
            return info

    def UnregisterAdapter(self, request, context):
        self._record("UnregisterAdapter", context)
        with self.lock:
            if request.id not in self.adapters:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"adapter {request.id} is not registered "
                              f"(registered ids: {sorted(self.adapters)})")
            del self.adapters[request.id]
            self.default.pop(request.id, None)
        return common_pb2.Empty()

    def SetDefaultAdapters(self, request, context):
        self._record("SetDefaultAdapters", context)
        for e in request.entries:
            if e.id not in self.adapters:
                context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {e.id} is not registered")
        self.default = {e.id: e.scale for e in request.entries if e.scale != 0}
        return self._default_map()

    # -- reads ---------------------------------------------------------------------------

    def _default_map(self) -> common_pb2.AdapterMap:
        entries = [common_pb2.AdapterScale(id=i, scale=s) for i, s in sorted(self.default.items())]
        return common_pb2.AdapterMap(entries=entries)

    def ListAdapters(self, request, context):
        self._record("ListAdapters", context)
        return control_plane_pb2.AdapterList(adapters=list(self.adapters.values()))

    def GetAdapter(self, request, context):
        self._record("GetAdapter", context)
        if request.id not in self.adapters:
            context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.id} is not registered")
        return self.adapters[request.id]

    def GetDefaultAdapters(self, request, context):
        self._record("GetDefaultAdapters", context)
        return self._default_map()

    def ListWorkers(self, request, context):
        self._record("ListWorkers", context)
        return control_plane_pb2.WorkerList(workers=[control_plane_pb2.WorkerInfo(
            worker_id="fake-0", addr="127.0.0.1:1", state="alive", last_heartbeat_age_s=0.2,
            model="fake", n_slots=4)])

    # -- generation ----------------------------------------------------------------------

    def Generate(self, request, context):
        self._record("Generate", context)
        self.received.generate.append(request)
        try:
            resolved = self._resolve(request)
        except KeyError as err:
            context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {err.args[0]} is not registered")
        prompt = toy_prompt_tokens(request)
        rid = request.request_id or "req-1"
        sampling = request.sampling
        started = common_pb2.Started(prompt_token_ids=prompt)
        if sampling.prompt_logprobs:
            started.prompt_logprobs.append(common_pb2.PromptLogprob(has_logprob=False))
            for j, t in enumerate(prompt[1:], start=1):
                started.prompt_logprobs.append(
                    common_pb2.PromptLogprob(has_logprob=True, token_id=t, logprob=-0.5 * j))
        yield common_pb2.GenerateEvent(request_id=rid, started=started)
        offset = 10 * sum(i for i, s in resolved.items() if s != 0)
        n = sampling.max_tokens or 16
        pieces = []
        for i in range(n):
            tid = 100 + i + offset
            piece = f"<t{tid}>"
            pieces.append(piece)
            top = [common_pb2.TokenLogprob(token_id=tid + k, logprob=-0.25 * (k + 1))
                   for k in range(sampling.logprobs)]
            yield common_pb2.GenerateEvent(request_id=rid, token=common_pb2.GeneratedToken(
                token_id=tid, text=piece, logprob=-0.25, top=top,
                step=common_pb2.StepTelemetry(batch_size=1, batch_tokens=1, n_adapter_sets=1,
                                              graph_reused=i > 0, n_nodes=1200,
                                              node_budget=2048, batching="mixed")))
        telemetry = common_pb2.RequestTelemetry(
            prompt_tokens=len(prompt), prefix_cache="keyed", alora_activation_pos=-1,
            worker_id="fake-0", graph_reuses=max(0, n - 1), graph_rebuilds=1,
            max_batch_size=1, max_adapter_sets_in_batch=1, ttft_ms=1.5, total_ms=3.0,
            adapters=[common_pb2.AdapterScale(id=i, scale=s)
                      for i, s in sorted(resolved.items()) if s != 0])
        yield common_pb2.GenerateEvent(request_id=rid, finished=common_pb2.Finished(
            finish_reason="length", text="".join(pieces), telemetry=telemetry))

    def RegisterWorker(self, request, context):
        return control_plane_pb2.WorkerAck(heartbeat_interval_ms=1000)

    def Heartbeat(self, request, context):
        return control_plane_pb2.WorkerAck(heartbeat_interval_ms=1000)


def start_fake(admin_token: str | None = None) -> tuple[grpc.Server, FakeControlPlane, str]:
    """A running fake on a free loopback port: ``(server, servicer, addr)``."""
    servicer = FakeControlPlane(admin_token)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    control_plane_pb2_grpc.add_ControlPlaneServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, servicer, f"127.0.0.1:{port}"
