"""Helpers for control-plane tests: a running server with a stub, upload helpers, and small
hand-made adapter GGUFs. The ``start_control_plane`` fixture (conftest.py) builds on these."""

from __future__ import annotations

from pathlib import Path

import gguf
import grpc
import numpy as np
import pytest

from loraplane.v1 import common_pb2, control_plane_pb2_grpc, membership_pb2_grpc
from loraplane.worker_secret import with_secret

MiB = 1 << 20


class ControlPlane:
    """A running control plane (``create_server``) and client stubs for it: ``stub``
    (ControlPlane) and ``membership_stub`` (WorkerMembership) send no credential,
    ``worker_stub`` (WorkerMembership) the config's worker secret (as a worker does)."""

    def __init__(self, config) -> None:
        from control_plane.server import create_server

        self.config = config
        self.server, self.port, self.state = create_server(config)
        self.addr = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(
            self.addr,
            options=[("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)],
        )
        self.stub = control_plane_pb2_grpc.ControlPlaneStub(self.channel)
        self.membership_stub = membership_pb2_grpc.WorkerMembershipStub(self.channel)
        self.worker_stub = membership_pb2_grpc.WorkerMembershipStub(with_secret(self.channel, config.worker_secret))
        self.stopped = False

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.channel.close()
        self.server.stop(None).wait()
        self.state.close()


def upload_chunks(path: Path, *, name: str = "", chunk: int = MiB):
    data = Path(path).read_bytes()
    yield common_pb2.AdapterChunk(name=name, data=data[:chunk])
    for i in range(chunk, len(data), chunk):
        yield common_pb2.AdapterChunk(data=data[i : i + chunk])


def upload(stub, path: Path, *, name: str = "", metadata=None) -> common_pb2.AdapterInfo:
    """RegisterAdapter by streaming the file's bytes in 1 MiB chunks."""
    return stub.RegisterAdapter(upload_chunks(path, name=name), metadata=metadata)


def by_path(stub, path: Path | str, *, metadata=None) -> common_pb2.AdapterInfo:
    """RegisterAdapter by server-side path."""
    return stub.RegisterAdapter(iter([common_pb2.AdapterChunk(server_path=str(path))]), metadata=metadata)


def write_adapter(
    path: Path, *, general_type: str = "adapter", seed: int = 0, r: int = 2, name: str | None = None
) -> Path:
    """A small adapter GGUF on ``blk.0.attn_q.weight`` of Gemma 3 270M (W ne [640, 1024]),
    ``general.name`` = ``name`` (default ``tiny<seed>``)."""
    w = gguf.GGUFWriter(str(path), arch="gemma3")
    w.add_type(general_type)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 4.0)
    w.add_name(f"tiny{seed}" if name is None else name)
    rng = np.random.default_rng(seed)
    w.add_tensor("blk.0.attn_q.weight.lora_a", rng.standard_normal((r, 640)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight.lora_b", rng.standard_normal((1024, r)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ids_of(stub) -> list[int]:
    return [a.id for a in stub.ListAdapters(common_pb2.Empty()).adapters]


def default_of(stub) -> list[tuple[int, float]]:
    return [(e.id, e.scale) for e in stub.GetDefaultAdapters(common_pb2.Empty()).entries]


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    """The RpcError ``fn(*args, **kwargs)`` raises (fails the test when it does not)."""
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value
