"""Regenerate the Python gRPC stubs in ``loraplane/v1/`` from ``protos/``.

Run ``python scripts/gen_protos.py`` after editing a ``.proto`` file; never edit the
generated ``*_pb2*.py`` files by hand. The ``.proto`` files themselves are copied next to
their stubs (``loraplane/v1/*.proto``, package data): the wheel ships them, so code for other
languages is generated from an installed package with ``protoc -I <site-packages>``.

Also regenerates ``loraplane/third_party/reflection_v1_pb2.py`` from the vendored
``third_party/grpc/reflection/v1/reflection.proto`` (grpcio-reflection ships only v1alpha;
`loraplane.reflection` serves v1 with it). Only its messages are generated: the servicer is
registered by hand, since generated gRPC stubs would import it as ``grpc.reflection.v1``.
"""

import shutil
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
VENDORED_REFLECTION = Path("grpc/reflection/v1/reflection.proto")
REFLECTION_OUT = ROOT / "loraplane" / "third_party"


def _protoc(args: list[str]) -> None:
    if protoc.main(["protoc", *args]) != 0:
        raise SystemExit("protoc failed")


def main() -> None:
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    _protoc(
        [
            f"-I{ROOT / 'protos'}",
            f"-I{include}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            *(str(p) for p in protos),
        ]
    )
    for p in protos:
        rel = p.relative_to(ROOT / "protos")
        shutil.copyfile(p, ROOT / rel)  # protos/loraplane/v1/x.proto -> loraplane/v1/x.proto
        print("generated", rel)
    with tempfile.TemporaryDirectory() as tmp:
        _protoc(
            [
                f"-I{ROOT / 'third_party'}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                str(ROOT / "third_party" / VENDORED_REFLECTION),
            ]
        )
        for suffix in (".py", ".pyi"):
            src = Path(tmp) / VENDORED_REFLECTION.parent / f"reflection_pb2{suffix}"
            shutil.copyfile(src, REFLECTION_OUT / f"reflection_v1_pb2{suffix}")
    print("generated", VENDORED_REFLECTION, "->", REFLECTION_OUT.relative_to(ROOT))


if __name__ == "__main__":
    main()
