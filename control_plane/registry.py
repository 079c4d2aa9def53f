"""The adapter registry: registration, validation, removal, pinning and the default adapter set.

`AdapterRegistry` (one per control-plane process, over one data dir and one `AdapterStore`)
registers uploads, server-side paths (confined to the adapter directories), start-up files and
PEFT folders (converted to GGUF here), each validated against the base model before anything
is stored; removes and pins adapters; and keeps the default set. Every read goes to the store.
Names and aliases are its ``names`` (`control_plane.names`); workers learn of adapters from
`control_plane.announcer`. The why (atomic registration, PEFT on the control plane, replicas):
docs/architecture.md, "Adapter registry".
"""

from __future__ import annotations

import errno
import hashlib
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from control_plane.base_model import BaseModelInfo
from control_plane.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    describe_ids,
)
from control_plane.names import AdapterNames, NameRemoval
from control_plane.resolution import check_scale, resolve_adapters
from control_plane.store import AdapterRecord, AdapterStore
from control_plane.store.base import DefaultScales
from loraplane.adapter_scales import NO_ADAPTERS, AdapterScales
from loraplane.formats.adapter_file import AdapterFile, read_lora_adapter
from loraplane.formats.convert_peft import convert_peft, is_peft_dir
from loraplane.paths import MalformedPath, OutsideAdapterDirs, confine, resolve_dirs

log = structlog.get_logger("loraplane.control_plane.registry")

DEFAULT_MAX_UPLOAD_BYTES = 512 * 1024 * 1024
SOURCE_FORMATS = ("gguf", "peft")


@dataclass(frozen=True)
class Registration:
    """Outcome of a registration: the record, and whether this call created it."""

    record: AdapterRecord
    created: bool
    aliased: bool = False  # known content: the requested name was added as an alias
    # this call attached the requested name (created under it, or aliased); False for a retry
    # that found the name already there, and when no name was requested
    named: bool = False


def adapter_metadata(adapter: AdapterFile, invocation_text: str) -> dict[str, Any]:
    """The JSON-able metadata stored with an adapter (everything `AdapterInfo` shows)."""
    return {
        "general_name": adapter.name,
        "arch": adapter.arch,
        "alpha": float(adapter.alpha),
        "ranks": [int(r) for r in adapter.ranks],
        "target_tensors": sorted(adapter.pairs),
        "task_name": adapter.task_name,
        "prompt_prefix": adapter.prompt_prefix,
        "alora_invocation_tokens": [int(t) for t in adapter.alora_invocation_tokens],
        "alora_invocation_text": invocation_text,
        "size_bytes": int(adapter.size_bytes),
        "n_nodes": int(adapter.n_nodes),
    }


class AdapterRegistry:
    """Registered adapters and the default set, persisted in an `AdapterStore`.

    Args:
        store: persistence (rows, id counter, default scales, adapter bytes).
        base: the base model index adapters are validated against.
        data_dir: uploads are received into temporary files under ``data_dir/adapters/``.
        adapter_dirs: directories server-side paths must resolve into.
        max_upload_bytes: larger uploads are refused (RESOURCE_EXHAUSTED).
        max_lora_rank: adapters with a larger rank are refused (INVALID_ARGUMENT): no
            worker's slot pool could hold them (``--max-lora-rank``).
        base_name: the served base-model name, which no adapter name may shadow (`names`).

    Attributes:
        names: the adapters' names and aliases (`control_plane.names.AdapterNames`): what a
            token names (``registry.names.lookup``), the naming rules, alias changes.
    """

    def __init__(
        self,
        store: AdapterStore,
        base: BaseModelInfo,
        *,
        data_dir: str | Path,
        adapter_dirs: Sequence[str | Path] = (),
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
        max_lora_rank: int = 64,
        base_name: str | None = None,
    ) -> None:
        self.store = store
        self.names = AdapterNames(store, base_name)
        self.base = base
        self.upload_dir = Path(data_dir) / "adapters"
        self.upload_dir.mkdir(parents=True, exist_ok=True)
        self.adapter_dirs = resolve_dirs(adapter_dirs)
        self.max_upload_bytes = int(max_upload_bytes)
        self._remove_partial_uploads()
        self.max_lora_rank = int(max_lora_rank)
        self._warn_arch_mismatch()

    # -- reads --------------------------------------------------------------------------

    def list(self) -> list[AdapterRecord]:
        return self.store.list()

    def get(self, adapter_id: int) -> AdapterRecord:
        rec = self.store.get(adapter_id)
        if rec is None:
            raise NotFoundError(
                f"adapter {adapter_id} not registered; {describe_ids([r.id for r in self.store.list()])}"
            )
        return rec

    def default_set(self) -> DefaultScales:
        """``[(id, scale)]`` for every registered adapter (0: detached), by id: the default
        scales themselves (``GetDefaultAdapters`` lists the zeros), not a request's
        `AdapterScales` (`resolve` gives that)."""
        return self.store.default_set()

    def resolve(self, request_map: Mapping[int, float] | None) -> AdapterScales:
        """A request's adapters, resolved against the default set as of now (its admission)
        (`control_plane.resolution.resolve_adapters`).

        An explicit empty map (the base model alone) needs nothing from the store, so such
        requests are served through a database outage.

        Raises:
            DatabaseUnavailableError: the store cannot be read (any other map).
        """
        if request_map is not None and not request_map:
            return NO_ADAPTERS
        return resolve_adapters(request_map, self.store.default_set())

    def read_chunks(self, record: AdapterRecord, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """The adapter's bytes in ``chunk_size`` pieces (for pushing to workers), from the store."""
        return self.store.read_chunks(record, chunk_size)

    # -- registration -------------------------------------------------------------------

    def register_upload(self, data: Iterable[bytes], *, name: str = "", source_format: str = "gguf") -> Registration:
        """Register uploaded bytes (streamed); the file is kept under the data dir.

        ``source_format`` records what the GGUF was made from ("peft": the client converted a
        PEFT folder before uploading); the bytes are validated as an adapter GGUF either way.

        Raises:
            ResourceExhaustedError: more than ``max_upload_bytes``.
            InvalidArgumentError: empty upload, an unknown ``source_format`` or an invalid
                adapter (message lists problems).
        """
        if source_format not in SOURCE_FORMATS:
            raise InvalidArgumentError(f"source_format '{source_format}': expected one of {list(SOURCE_FORMATS)}")
        self.names.check(name)
        tmp = self.upload_dir / f".upload-{uuid.uuid4().hex}.part"
        try:
            sha256, size = self._receive(data, tmp)
            if size == 0:
                raise InvalidArgumentError("adapter upload carried no data")
            adapter = self._validate(tmp, shown_as="uploaded adapter")
            existing = self.store.get_by_sha256(sha256)
            if existing is not None:
                return self._known(existing, name)
            self.names.check_free(name)
            rec, created = self.store.insert(
                sha256=sha256,
                name="" if name else self.names.embedded(adapter.name),  # a requested one: `claim`
                metadata=self._metadata(adapter),
                content=tmp,
                source=None,
                source_format=source_format,
            )
        finally:
            tmp.unlink(missing_ok=True)
        if not created:  # another replica registered the same content meanwhile
            return self._known(rec, name)
        rec = self.names.claim(rec, name)
        log.info("adapter_registered", adapter_id=rec.id, sha256=sha256, source="upload", size=size)
        return Registration(rec, created, named=bool(name))

    def register_server_path(self, path: str, *, name: str = "") -> Registration:
        """Register a file already on the server; it must lie inside an adapter dir.

        Raises:
            InvalidArgumentError: a relative path, a NUL byte, a name too long for the file
                system, or an invalid adapter.
            PermissionDeniedError: the resolved path is outside every adapter dir (nothing read).
            NotFoundError: no such file.
        """
        self.names.check(name)
        try:
            resolved = confine(path, self.adapter_dirs)
        except MalformedPath as exc:
            raise InvalidArgumentError(str(exc)) from None
        except OutsideAdapterDirs as exc:
            raise PermissionDeniedError(str(exc)) from None
        try:
            return self._register_file(resolved, name=name, source="server_path")
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG:
                raise
            raise InvalidArgumentError(f"server path '{path}': {exc.strerror}") from None

    def register_startup(self, path: str | Path, scale: float) -> AdapterRecord:
        """Register a ``--lora``/``--lora-scaled`` file (trusted: no adapter-dir check) and
        set its default scale. Errors propagate so the server refuses to start."""
        scale = check_scale(scale, f"startup adapter '{path}'")
        resolved = Path(path).resolve()
        rec = self._register_file(resolved, name="", source="startup").record
        self.store.set_default_scales({rec.id: scale}, others=None)
        return self.get(rec.id)

    def _register_file(self, path: Path, *, name: str, source: str) -> Registration:
        self.names.check(name)
        if is_peft_dir(path):
            return self._register_peft(path, name=name)
        if not path.is_file():
            raise NotFoundError(f"adapter file '{path}' does not exist")
        adapter = self._validate(path, shown_as=str(path))
        sha256 = adapter.sha256
        existing = self.store.get_by_sha256(sha256)
        if existing is not None:
            return self._known(existing, name)
        self.names.check_free(name)
        rec, created = self.store.insert(
            sha256=sha256,
            name="" if name else self.names.embedded(adapter.name),  # a requested one: `claim`
            metadata=self._metadata(adapter),
            content=path,
            source=str(path),
        )
        if not created:
            return self._known(rec, name)
        rec = self.names.claim(rec, name)
        log.info("adapter_registered", adapter_id=rec.id, sha256=sha256, source=source, path=str(path))
        return Registration(rec, created, named=bool(name))

    def _known(self, rec: AdapterRecord, name: str) -> Registration:
        """Content already registered as ``rec``, asked for again under ``name``: unchanged
        when ``name`` is empty or already one of its names (a retried registration), else
        ``name`` becomes an alias of it (`AdapterNames.add`).

        Raises:
            AlreadyExistsError: another adapter answers to ``name``.
        """
        if not name or name in rec.names:
            return Registration(rec, created=False)
        updated, added = self.names.add(rec, name)
        if not added:
            return Registration(updated, created=False)
        return Registration(updated, created=False, aliased=added == "alias", named=True)

    def _register_peft(self, folder: Path, *, name: str) -> Registration:
        """Convert a PEFT folder (rules of ``convert-peft``) and register the GGUF as an upload.

        Raises:
            InvalidArgumentError: the folder cannot be converted (every problem listed).
        """
        tmp = self.upload_dir / f".peft-{uuid.uuid4().hex}.gguf"
        try:
            try:
                convert_peft(folder, tmp, base_gguf=self.base.gguf)
            except ValueError as exc:  # ConvertError lists every problem
                raise InvalidArgumentError(f"PEFT folder '{folder}': {exc}") from exc
            reg = self.register_upload(self.read_path_chunks(tmp), name=name, source_format="peft")
        finally:
            tmp.unlink(missing_ok=True)
        log.info("peft_converted", adapter_id=reg.record.id, folder=str(folder), sha256=reg.record.sha256)
        return reg

    @staticmethod
    def read_path_chunks(path: Path, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        with open(path, "rb") as fh:
            yield from iter(lambda: fh.read(chunk_size), b"")

    def _receive(self, data: Iterable[bytes], tmp: Path) -> tuple[str, int]:
        h = hashlib.sha256()
        size = 0
        with open(tmp, "wb") as fh:
            for piece in data:
                size += len(piece)
                if size > self.max_upload_bytes:
                    raise ResourceExhaustedError(
                        f"adapter upload exceeds the limit of {self.max_upload_bytes} bytes "
                        f"(--max-upload-bytes); received {size} so far"
                    )
                h.update(piece)
                fh.write(piece)
        return h.hexdigest(), size

    def _validate(self, path: Path, *, shown_as: str) -> AdapterFile:
        try:
            adapter = read_lora_adapter(path, base_arch=self.base.arch, base_tensors=self.base.tensor_ne)
        except ValueError as exc:  # AdapterError / GGUFError: both name the problem
            raise InvalidArgumentError(str(exc).replace(str(path), shown_as)) from exc
        rank = max(adapter.ranks, default=0)
        if rank > self.max_lora_rank:
            raise InvalidArgumentError(
                f"{shown_as}: rank {rank} exceeds --max-lora-rank {self.max_lora_rank} "
                "(workers' adapter slots are padded to that rank)"
            )
        return adapter

    def _metadata(self, adapter: AdapterFile) -> dict[str, Any]:
        text = self.base.decode(list(adapter.alora_invocation_tokens))
        return adapter_metadata(adapter, text)

    # -- removal and the default set ----------------------------------------------------

    def unregister(self, adapter_id: int) -> AdapterRecord:
        """Remove an adapter (and its default-set entry); its id is never reused.

        Raises:
            NotFoundError: unknown id (the message lists the registered ids).
        """
        rec = self.store.delete(adapter_id)
        if rec is None:
            raise NotFoundError(
                f"adapter {adapter_id} not registered; {describe_ids([r.id for r in self.store.list()])}"
            )
        log.info("adapter_unregistered", adapter_id=adapter_id, sha256=rec.sha256)
        return rec

    def unload_name(self, token: str) -> NameRemoval:
        """vLLM's ``unload_lora_adapter``: drop the name ``token``, not more (`AdapterNames.drop`:
        an alias goes; a name with aliases hands over to its oldest alias; a last name
        unregisters the adapter). ``token`` an id (ASCII digits, ``adapter:<id>``) → the adapter
        is unregistered (`unregister`). The caller unloads an unregistered adapter from the
        workers. (An alias of an unnamed adapter goes alone: the adapter was registered by
        someone else and stays, as ``adapter:<id>``.)

        Raises:
            NotFoundError / AmbiguousNameError: ``token`` names no / several adapters (also
                when a racing unload took the name first).
        """
        rec = self.get(self.names.lookup(token))
        if token not in rec.names:  # an id
            return NameRemoval(self.unregister(rec.id), unregistered=True)
        return self.names.drop(rec, token)

    def set_pinned(self, adapter_id: int, pinned: bool) -> AdapterRecord:
        """Pin (never evicted on workers) or unpin an adapter.

        Raises:
            NotFoundError: unknown id.
        """
        rec = self.store.set_pinned(adapter_id, pinned)
        if rec is None:
            raise NotFoundError(
                f"adapter {adapter_id} not registered; {describe_ids([r.id for r in self.store.list()])}"
            )
        log.info("adapter_pinned" if pinned else "adapter_unpinned", adapter_id=adapter_id)
        return rec

    def get_by_sha256(self, sha256: str) -> AdapterRecord:
        """The record of content ``sha256`` (workers fetch bytes by it).

        Raises:
            NotFoundError: no registered adapter has that content.
        """
        rec = self.store.get_by_sha256(sha256)
        if rec is None:
            raise NotFoundError(f"no registered adapter has sha256 {sha256}")
        return rec

    def set_default_set(self, scales: Mapping[int, float]) -> DefaultScales:
        """Replace the default set: listed ids at their scale, every other adapter at 0.

        Raises:
            NotFoundError: an unknown id; InvalidArgumentError: a negative/non-finite scale.
        """
        registered = {i for i, _ in self.store.default_set()}
        unknown = sorted(set(scales) - registered)
        if unknown:
            raise NotFoundError(f"adapter id(s) {unknown} not registered; {describe_ids(registered)}")
        checked = {int(i): check_scale(s, f"adapter {i}") for i, s in scales.items()}
        self.store.set_default_scales(checked, others=0.0)
        log.info("default_set_changed", default_set=checked)
        return self.default_set()

    def detach_all(self) -> None:
        """Every default scale to 0 (``--lora-init-without-apply``: load all, apply none)."""
        self.store.set_default_scales({}, others=0.0)

    def _remove_partial_uploads(self) -> None:
        """Delete ``.upload-*.part`` files and ``.peft-*.gguf`` conversions a crash mid-upload
        left behind (this process owns the data dir, so none can belong to a live upload at
        start-up)."""
        for pattern in (".upload-*.part", ".peft-*.gguf"):
            for part in self.upload_dir.glob(pattern):
                part.unlink(missing_ok=True)
                log.info("partial_upload_removed", path=str(part))

    def _warn_arch_mismatch(self) -> None:
        for rec in self.store.list():
            if rec.metadata.get("arch") != self.base.arch:
                log.warning(
                    "adapter_arch_mismatch",
                    adapter_id=rec.id,
                    adapter_arch=rec.metadata.get("arch"),
                    base_arch=self.base.arch,
                )
