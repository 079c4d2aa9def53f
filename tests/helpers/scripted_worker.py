"""A scripted worker: a real gRPC server implementing the ``loraplane.v1.Worker`` service from the
proto (no model), joined to a control plane by the worker's own membership thread.

``ScriptedWorker`` records what the control plane sends (adapter chunks, the submitted request)
and answers Decode by the prompt text: ``"hang"`` waits until cancelled, ``"fail"`` dies after one
token, ``"token then hang"`` waits after one token, ``"refuse"`` rejects the request; anything else
streams Started, two tokens and Finished. With ``stall`` set, Decode sends nothing and blocks
until cancelled (a worker process stopped or hung mid-request); with ``down`` set it fails with
UNAVAILABLE before any event. ``ScriptedMember`` is that server plus its membership thread. The
``cluster`` fixture of ``tests/integration/conftest.py`` starts a control plane with some.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from concurrent import futures

import grpc

from loraplane.v1 import common_pb2, control_plane_pb2, membership_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers.control_plane import MiB
from tests.helpers.live_servers import WORKER_SECRET
from worker.rpc.membership import MembershipBackoff, start_membership

FAST = MembershipBackoff(connect_timeout_s=1.0, initial_s=0.05, max_s=0.2)


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.adapters: dict[int, str] = {}  # id → sha256 held
        self.load_calls: list[list[common_pb2.AdapterChunk]] = []
        self.unloaded: list[int] = []
        self.submitted: list[common_pb2.GenerateRequest] = []
        self.tenants: list[worker_pb2.RequestTenant] = []  # DecodeRequest.tenant of each submit
        self.cancelled = threading.Event()
        self.n_cancelled = 0
        self.down = False  # Decode fails with UNAVAILABLE before any event
        self.stall = False  # Decode blocks before any event until cancelled
        self.lock = threading.Lock()

    def LoadAdapter(self, request_iterator, context):
        chunks = list(request_iterator)
        data = b"".join(c.data for c in chunks)
        first = chunks[0]
        if not first.fetch_on_demand and hashlib.sha256(data).hexdigest() != first.sha256:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"adapter {first.id}: sha256 mismatch")
        with self.lock:
            self.load_calls.append(chunks)
            self.adapters[first.id] = first.sha256
        return common_pb2.AdapterInfo(id=first.id, sha256=first.sha256)

    def UnloadAdapter(self, request, context):
        with self.lock:
            self.adapters.pop(request.id, None)
            self.unloaded.append(request.id)
        return common_pb2.Empty()

    def ListAdapters(self, request, context):
        with self.lock:
            infos = [common_pb2.AdapterInfo(id=i, sha256=s) for i, s in sorted(self.adapters.items())]
        return worker_pb2.WorkerAdapterList(adapters=infos)

    def Decode(self, request_iterator, context):
        first = next(request_iterator)
        req = first.submit
        with self.lock:
            self.submitted.append(req)
            self.tenants.append(first.tenant)
        rid, text = req.request_id, req.text
        if self.down:
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")
        if text == "refuse":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
        if self.stall:
            self._block_until_cancelled(context, 60)
            return
        yield common_pb2.GenerateEvent(request_id=rid, started=common_pb2.Started(prompt_token_ids=[2, 9]))
        if text == "hang":
            self._block_until_cancelled(context, 30)
            return
        yield common_pb2.GenerateEvent(request_id=rid, token=common_pb2.GeneratedToken(token_id=7, text="a"))
        if text == "token then hang":
            self._block_until_cancelled(context, 30)
            return
        if text == "fail":
            context.abort(grpc.StatusCode.INTERNAL, "CUDA error: boom")
        yield common_pb2.GenerateEvent(request_id=rid, token=common_pb2.GeneratedToken(token_id=8, text="b"))
        yield common_pb2.GenerateEvent(request_id=rid, finished=common_pb2.Finished(finish_reason="length", text="ab"))

    def _block_until_cancelled(self, context, timeout_s: float) -> None:
        done = threading.Event()
        context.add_callback(done.set)
        done.wait(timeout_s)
        if not context.is_active():
            with self.lock:
                self.n_cancelled += 1
            self.cancelled.set()


class ScriptedMember:
    """A scripted worker server plus its membership thread (presenting ``secret``; ``refresh``,
    when given, fills each heartbeat's hello as a real worker does: residency, paging, KV cells)."""

    secret: str | None = WORKER_SECRET
    refresh: Callable[[membership_pb2.WorkerHello], None] | None = None

    def __init__(
        self,
        worker_id: str,
        cp_addr: str,
        n_slots: int = 2,
        secret: str | None = WORKER_SECRET,
        refresh: Callable[[membership_pb2.WorkerHello], None] | None = None,
    ) -> None:
        self.secret = secret
        self.refresh = refresh
        self.servicer = ScriptedWorker(worker_id)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16), options=[("grpc.max_receive_message_length", 64 * MiB)]
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.hello = membership_pb2.WorkerHello(
            worker_id=worker_id, addr=f"127.0.0.1:{self.port}", model="gemma3", n_slots=n_slots
        )
        self.cp_addr = cp_addr
        self.stop_event = threading.Event()
        self.thread = None
        self.join()

    def join(self) -> None:
        self.stop_event = threading.Event()
        self.thread = start_membership(
            self.cp_addr, self.hello, self.stop_event, backoff=FAST, secret=self.secret, refresh=self.refresh
        )
        assert self.thread.registered.wait(20), "worker did not register"

    def leave(self) -> None:
        self.stop_event.set()
        self.thread.join(5)

    def close(self) -> None:
        self.leave()
        self.server.stop(None)


def workers_of(cp) -> dict[str, control_plane_pb2.WorkerInfo]:
    """The control plane's ``ListWorkers`` answer by worker id."""
    return {w.worker_id: w for w in cp.stub.ListWorkers(common_pb2.Empty()).workers}


def generate(
    cp, text: str, adapters: dict[int, float] | None = None, request_id: str = ""
) -> list[common_pb2.GenerateEvent]:
    """Every event of one ``Generate`` call of ``text`` on ``cp`` (``adapters``: id → scale, or None
    for no adapter map), in order; raises ``grpc.RpcError`` as the stream does."""
    req = common_pb2.GenerateRequest(request_id=request_id, text=text)
    if adapters is not None:
        req.adapters.SetInParent()
        req.adapters.entries.extend(common_pb2.AdapterScale(id=i, scale=s) for i, s in adapters.items())
    return list(cp.stub.Generate(req))
