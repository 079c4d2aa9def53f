"""Confinement of server-side paths to configured directories (both planes use this one rule).

A path given over the wire (``RegisterAdapter`` at the control plane, ``LoadAdapter`` at a
worker) may only name a file inside one of the operator's ``--adapter-dir`` directories. The
check runs on the *resolved* path (symlinks followed, ``..`` collapsed) and BEFORE anything is
opened or even tested for existence, so a refused path leaks neither content nor existence.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class PathRefused(ValueError):
    """Base class: a server-side path that may not be read."""


class MalformedPath(PathRefused):
    """Empty, relative, or containing a NUL byte (the OS cannot even name it)."""


class OutsideAdapterDirs(PathRefused):
    """The resolved path lies outside every allowed directory (or none is configured)."""


def is_inside(path: Path, root: Path) -> bool:
    """True when resolved ``path`` is ``root`` or below it (both already resolved)."""
    return path == root or root in path.parents


def resolve_dirs(dirs: Sequence[str | Path]) -> tuple[Path, ...]:
    """The allowed directories, resolved once at start-up."""
    return tuple(Path(d).resolve() for d in dirs)


def confine(path: str, allowed: Sequence[Path], *, flag: str = "--adapter-dir") -> Path:
    """``path`` resolved, if it lies inside one of ``allowed`` (already resolved dirs).

    Nothing is opened; only ``os.path.realpath`` runs (it reads symlinks, not files).

    Raises:
        MalformedPath: empty, NUL byte, or not absolute.
        OutsideAdapterDirs: resolves outside every directory of ``allowed`` (message lists
            them, or says none is configured and names ``flag``).
    """
    if not path:
        raise MalformedPath("server path is empty")
    if "\x00" in path:
        raise MalformedPath(f"server path {path!r} contains a NUL byte")
    if not Path(path).is_absolute():
        raise MalformedPath(f"server path '{path}' must be absolute")
    resolved = Path(path).resolve()
    if not any(is_inside(resolved, d) for d in allowed):
        shown = [str(d) for d in allowed] or f"none configured ({flag})"
        raise OutsideAdapterDirs(
            f"server path '{path}' resolves to '{resolved}', outside the adapter directories ({shown})"
        )
    return resolved
