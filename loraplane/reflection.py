"""gRPC server reflection, both versions: ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcio-reflection implements only v1alpha; current tools (grpcurl, Postman, grpcui, buf curl)
ask for v1 first. The two protocols have identical messages (grpc/grpc-proto: v1 is v1alpha
renamed), so the v1 service re-encodes each request as v1alpha, lets grpcio-reflection's own
`ReflectionServicer` answer it, and re-encodes the answers as v1. The v1 messages come from
the vendored ``third_party/grpc/reflection/v1/reflection.proto`` (Apache-2.0, grpc-proto),
generated into `loraplane.third_party.reflection_v1_pb2` by ``scripts/gen_protos.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from loraplane.third_party import reflection_v1_pb2 as v1_pb2

V1_SERVICE_NAME = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
"""``grpc.reflection.v1.ServerReflection``."""
V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME
"""``grpc.reflection.v1alpha.ServerReflection``."""


def enable_reflection(service_names: Iterable[str], server: grpc.Server) -> tuple[str, ...]:
    """Serve reflection v1 and v1alpha on ``server`` for ``service_names`` plus both
    reflection services themselves; returns the names listed (``list_services``).

    Descriptors come from the default descriptor pool (every imported ``*_pb2`` module).
    """
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = v1alpha.ReflectionServicer(names)
    v1alpha.enable_server_reflection(names, server)

    def info(requests: Iterator[v1_pb2.ServerReflectionRequest], context) -> Iterator[v1_pb2.ServerReflectionResponse]:
        as_v1alpha = (v1alpha_pb2.ServerReflectionRequest.FromString(r.SerializeToString()) for r in requests)
        for response in servicer.ServerReflectionInfo(as_v1alpha, context):
            yield v1_pb2.ServerReflectionResponse.FromString(response.SerializeToString())

    handler = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                info,
                request_deserializer=v1_pb2.ServerReflectionRequest.FromString,
                response_serializer=v1_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    return names
