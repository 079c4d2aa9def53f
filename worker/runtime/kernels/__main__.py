"""``python -m worker.runtime.kernels``: check the C kernels as installed (what
``scripts/install.sh`` runs after the editable install, and the Docker image's smoke check):
every ISA's library is there for the sources beside it, and the one of this CPU's path loads.
Exit status 1, with what to run, when a required library is missing or does not load; the
optional ``amx`` library only warns.
"""

from __future__ import annotations

import sys

from worker.runtime.kernels.build import ISA_FLAGS, OPTIONAL_ISAS, KernelBuildError
from worker.runtime.kernels.cpu import best_path
from worker.runtime.kernels.library import library_path, load


def main() -> int:
    """Print each ISA's library and this CPU's path; 1 when a required one fails."""
    status = 0
    for isa in ISA_FLAGS:
        try:
            print(f"kernels: {isa}: {library_path(isa)}")
        except KernelBuildError as exc:
            print(f"kernels: {exc}", file=sys.stderr)
            status = status or int(isa not in OPTIONAL_ISAS)
    path = best_path()
    if path != "torch" and not status:
        try:
            load(path)
        except KernelBuildError as exc:
            print(f"kernels: {exc}", file=sys.stderr)
            return 1
    print(f"kernels: this CPU runs the {path} path")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
