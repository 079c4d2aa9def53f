"""Regenerate the Python gRPC stubs in ``loraplane/v1/`` from ``protos/``.

Run ``python scripts/gen_protos.py`` after editing a ``.proto`` file; never edit the
generated ``*_pb2*.py`` files by hand.
"""

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT / 'protos'}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
    ]
    args += [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for p in protos:
        print("generated", p.relative_to(ROOT / "protos"))


if __name__ == "__main__":
    main()
