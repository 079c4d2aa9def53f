"""loraplane API package: generated gRPC stubs live in loraplane.v1 (see scripts/gen_protos.py)."""
