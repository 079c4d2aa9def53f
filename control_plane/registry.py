"""The adapter registry: registration, removal, metadata and the global default adapter set.

Owner: the control-plane process (one `AdapterRegistry` per process, over one data dir).
Workers never register anything themselves; they receive adapters the registry accepted
(`control_plane.workers` pushes them).

Registration validates the whole file against the base model's tensor index
(`loraplane.formats.adapter_file.read_lora_adapter`, numpy only) before anything is stored.
Uploaded bytes land in a temporary file under ``<data-dir>/adapters/`` (local to this process)
and are handed to the
store only once valid; the store keeps the row and the bytes together or not at all
(`control_plane.store.base.AdapterStore.insert`: a file under the data dir for SQLite, the
database itself for PostgreSQL, where server paths and start-up files are copied in too).
Any failure removes the temporary file, so a refused upload leaves neither a row nor bytes.
Server-side paths must resolve (symlinks followed) inside a configured adapter directory,
checked before the file is opened.

Every read goes to the store, so with several replicas on one PostgreSQL a registration or
default-set change made through one is what the next call on any other sees.

PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``) are accepted wherever a
server-side path is (``--lora``, ``--lora-scaled``, ``RegisterAdapter.server_path``): they are
converted here, on the control plane, by the same numpy-only code as ``convert-peft``
(`loraplane.formats.convert_peft`, rsLoRA and aLoRA included) against the base model this process
already indexed, and the resulting GGUF is kept under ``<data-dir>/adapters/`` like an upload
(the record's ``source_format`` is "peft"). Workers only ever receive GGUF files.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import unicodedata
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from control_plane.base_model import BaseModelInfo
from control_plane.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
    describe_ids,
    echo,
)
from control_plane.resolution import (
    ID_PREFIX,
    AdapterVector,
    check_scale,
    find_adapter,
    is_id_token,
    resolve_adapter_vector,
)
from control_plane.store import AdapterRecord, AdapterStore
from loraplane.formats.adapter_file import AdapterFile, read_lora_adapter
from loraplane.formats.convert_peft import convert_peft, is_peft_dir
from loraplane.limits import MAX_ADAPTER_NAME_BYTES
from loraplane.paths import MalformedPath, OutsideAdapterDirs, confine, resolve_dirs

log = structlog.get_logger("loraplane.control_plane.registry")

DEFAULT_MAX_UPLOAD_BYTES = 512 * 1024 * 1024
SOURCE_FORMATS = ("gguf", "peft")


ID_NAME_PREFIX = ID_PREFIX
"""``adapter:<id>`` names an adapter by id, so no name may start with it."""


def served_base_name(served_model_name: str | None, base_path: str | Path) -> str:
    """The base model's name on the HTTP API: ``--served-model-name``, else the GGUF file's stem."""
    return served_model_name or Path(str(base_path)).name.removesuffix(".gguf")


def name_clash(name: str, base_name: str | None) -> str | None:
    """Why ``name`` cannot name an adapter, or None when it can: it equals the served base-model
    name ``base_name``, starts with ``<base_name>:`` (the ``base:adapter`` form) or with
    ``adapter:`` (the id form). Such a name would be shadowed on the HTTP API (``model``
    resolves the base and the id forms first) and list an id twice in ``/v1/models``. A name
    of ASCII digits only is refused too: such a token always names an adapter id on every API
    (`resolution.is_id_token`). So is a name holding a control character (Unicode category
    Cc: NUL, which PostgreSQL text cannot store, newline, tab, ...), which no client can put in
    a URL path or a table cell and mean, and one over `MAX_ADAPTER_NAME_BYTES` UTF-8 bytes
    (every ``/v1/models`` answer repeats every name)."""
    n_bytes = len(name.encode("utf-8", "surrogatepass"))
    if n_bytes > MAX_ADAPTER_NAME_BYTES:
        return f"adapter name '{echo(name)}' has {n_bytes} bytes (UTF-8); the limit is {MAX_ADAPTER_NAME_BYTES}"
    bad = next((c for c in name if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        return f"adapter name {name!r} holds the control character U+{ord(bad):04X}; pick a printable name"
    if is_id_token(name):
        return f"adapter name '{name}' is all digits, which names an adapter id; pick a name with a non-digit"
    if base_name and name == base_name:
        return f"adapter name '{name}' is the served base model's name; pick another"
    if base_name and name.startswith(base_name + ":"):
        return f"adapter name '{name}' starts with '{base_name}:' (the base-model prefix form); pick another"
    if name.startswith(ID_NAME_PREFIX):
        return f"adapter name '{name}' starts with '{ID_NAME_PREFIX}' (the id form); pick another"
    return None


@dataclass(frozen=True)
class Registration:
    """Outcome of a registration: the record, and whether this call created it."""

    record: AdapterRecord
    created: bool
    aliased: bool = False  # known content: the requested name was added as an alias
    # this call attached the requested name (created under it, or aliased); False for a retry
    # that found the name already there, and when no name was requested
    named: bool = False


@dataclass(frozen=True)
class NameRemoval:
    """Outcome of `AdapterRegistry.unload_name`: the record as it is now (as it was, when
    ``unregistered``), and whether the adapter itself was unregistered."""

    record: AdapterRecord
    unregistered: bool


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
        base_name: the served base-model name (`served_base_name`); a requested adapter name
            that would shadow it is refused (INVALID_ARGUMENT, `name_clash`), a clashing name
            embedded in the file is dropped (the adapter is served as ``adapter:<id>``).
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
        self.base_name = base_name
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

    def lookup(self, token: str) -> int:
        """The id ``token`` names: ASCII digits or ``adapter:<id>`` an id, anything else a name
        or alias (`resolution.find_adapter`, the rule every API shares).

        Raises:
            NotFoundError / AmbiguousNameError: see `resolution.find_adapter`.
        """
        return find_adapter(token, self.store.list())

    def name_owners(self, name: str) -> builtins.list[int]:
        """Ids of the adapters that answer to ``name`` (as name or alias)."""
        return [r.id for r in self.store.list() if name in r.names]

    def default_set(self) -> AdapterVector:
        """``[(id, scale)]`` for every registered adapter (0: detached), by id."""
        return self.store.default_set()

    def resolve(self, request_map: Mapping[int, float] | None) -> AdapterVector:
        """A request's resolved vector against the default set as of now (its admission).

        An explicit empty map (the base model alone) needs nothing from the store, so such
        requests are served through a database outage.

        Raises:
            DatabaseUnavailableError: the store cannot be read (any other map).
        """
        if request_map is not None and not request_map:
            return []
        return resolve_adapter_vector(request_map, self.store.default_set())

    def read_chunks(self, record: AdapterRecord, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """The adapter's bytes in ``chunk_size`` pieces (for pushing to workers), from the store."""
        return self.store.read_chunks(record, chunk_size)

    # -- registration -------------------------------------------------------------------

    def check_name(self, name: str) -> None:
        """Refuse a requested adapter name that would shadow the base model or an id
        (`name_clash`); "" (no name: the file's own) passes.

        Raises:
            InvalidArgumentError: the clash, named.
        """
        problem = name_clash(name, self.base_name) if name else None
        if problem:
            raise InvalidArgumentError(problem)

    def _name_of(self, requested: str, adapter: AdapterFile) -> str:
        """The name to store: the requested one (checked), else the file's own unless it clashes."""
        if requested:
            self.check_name(requested)
            return requested
        embedded = adapter.name or ""
        problem = name_clash(embedded, self.base_name) if embedded else None
        if problem:
            log.warning("adapter_name_dropped", name=echo(embedded), reason=problem)
            return ""
        return embedded

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
        self.check_name(name)
        tmp = self.upload_dir / f".upload-{uuid.uuid4().hex}.part"
        try:
            sha256, size = self._receive(data, tmp)
            if size == 0:
                raise InvalidArgumentError("adapter upload carried no data")
            adapter = self._validate(tmp, shown_as="uploaded adapter")
            existing = self.store.get_by_sha256(sha256)
            if existing is not None:
                return self._known(existing, name)
            self._check_free(name)
            rec, created = self.store.insert(
                sha256=sha256,
                name="" if name else self._name_of(name, adapter),  # a requested name: `_claim`
                metadata=self._metadata(adapter),
                content=tmp,
                source=None,
                source_format=source_format,
            )
        finally:
            tmp.unlink(missing_ok=True)
        if not created:  # another replica registered the same content meanwhile
            return self._known(rec, name)
        rec = self._claim(rec, name)
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
        self.check_name(name)
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
        self.check_name(name)
        if is_peft_dir(path):
            return self._register_peft(path, name=name)
        if not path.is_file():
            raise NotFoundError(f"adapter file '{path}' does not exist")
        adapter = self._validate(path, shown_as=str(path))
        sha256 = adapter.sha256
        existing = self.store.get_by_sha256(sha256)
        if existing is not None:
            return self._known(existing, name)
        self._check_free(name)
        rec, created = self.store.insert(
            sha256=sha256,
            name="" if name else self._name_of(name, adapter),  # a requested name: `_claim`
            metadata=self._metadata(adapter),
            content=path,
            source=str(path),
        )
        if not created:
            return self._known(rec, name)
        rec = self._claim(rec, name)
        log.info("adapter_registered", adapter_id=rec.id, sha256=sha256, source=source, path=str(path))
        return Registration(rec, created, named=bool(name))

    def _claim(self, rec: AdapterRecord, name: str) -> AdapterRecord:
        """Give the just-inserted, still unnamed ``rec`` the requested ``name`` in the store's
        serialised name transaction (`AdapterStore.set_names`), so that of several callers
        (threads or replicas) registering different content under one new name at once, one
        gets it and the others fail: `_check_free` ran before the insert and cannot see them.
        A loser's record is unregistered again unless someone gave it a name meanwhile.

        Raises:
            AlreadyExistsError: another adapter, or another call, took ``name`` first.
            UnavailableError: ``rec`` was unregistered meanwhile.
        """
        if not name:
            return rec

        def take(current: AdapterRecord, records: list[AdapterRecord]) -> tuple[str, tuple[str, ...]]:
            owners = [r.id for r in records if name in r.names and r.id != current.id]
            if owners or name in current.names:
                raise AlreadyExistsError(
                    f"adapter name '{name}' is taken by adapter(s) {owners or [current.id]}; pick another name"
                )
            if current.name:  # named meanwhile (same content registered by another call)
                return current.name, (*current.aliases, name)
            return name, current.aliases

        try:
            updated = self.store.set_names(rec.id, take)
        except Exception as exc:  # name taken (or the store failed): no nameless row left behind
            now = self.store.get(rec.id)
            if now is not None and not now.names:
                self.store.delete(rec.id)
                log.info("adapter_registration_undone", adapter_id=rec.id, name=name, reason=type(exc).__name__)
            raise
        if updated is None:
            raise UnavailableError(f"adapter {rec.id} was unregistered while '{name}' was being given to it; retry")
        return updated

    def _check_free(self, name: str) -> None:
        """Refuse a requested ``name`` an adapter already answers to ("": nothing to check).

        Raises:
            AlreadyExistsError: naming the name and the adapter(s) holding it.
        """
        owners = self.name_owners(name) if name else []
        if owners:
            raise AlreadyExistsError(f"adapter name '{name}' is taken by adapter(s) {owners}; pick another name")

    def _known(self, rec: AdapterRecord, name: str) -> Registration:
        """Content already registered as ``rec``, asked for again under ``name``: unchanged
        when ``name`` is empty or already one of its names (a retried registration), else
        ``name`` becomes an alias of it (vLLM's ``load_lora_adapter`` of the same files under a
        new ``lora_name``: the new name must serve at once).

        Raises:
            AlreadyExistsError: another adapter answers to ``name``.
        """
        if not name or name in rec.names:
            return Registration(rec, created=False)
        added = ""  # "alias", or "name": the record was still unnamed (another call's insert, not yet claimed)

        def add_alias(current: AdapterRecord, records: list[AdapterRecord]) -> tuple[str, tuple[str, ...]]:
            nonlocal added
            owners = [r.id for r in records if name in r.names and r.id != current.id]
            if owners:
                raise AlreadyExistsError(f"adapter name '{name}' is taken by adapter(s) {owners}; pick another name")
            if name in current.names:  # another call added it meanwhile
                return current.name, current.aliases
            if not current.name:  # never an alias of a nameless record: the name becomes its name
                added = "name"
                return name, current.aliases
            added = "alias"
            return current.name, (*current.aliases, name)

        updated = self.store.set_names(rec.id, add_alias)
        if updated is None:  # unregistered between the lookup and now
            raise UnavailableError(f"adapter {rec.id} was unregistered while '{name}' was being added; retry")
        if not added:
            return Registration(updated, created=False)
        if added == "alias":
            log.info("adapter_alias_added", adapter_id=rec.id, alias=name, sha256=rec.sha256)
        else:
            log.info("adapter_named", adapter_id=rec.id, name=name, sha256=rec.sha256)
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
        """vLLM's ``unload_lora_adapter``: drop the name ``token``, not more.

        * ``token`` is an alias → that alias goes; the adapter stays (same id, other names);
        * ``token`` is the adapter's name and it has aliases → its oldest alias becomes its
          name; the adapter stays, so a client that loaded it under another name keeps it;
        * ``token`` is its name and it has no aliases, or an id (ASCII digits,
          ``adapter:<id>``) → the adapter is unregistered (`unregister`); the caller unloads
          it from the workers. (An alias of an unnamed adapter goes alone: the adapter was
          registered by someone else and stays, as ``adapter:<id>``.)

        Raises:
            NotFoundError / AmbiguousNameError: ``token`` names no / several adapters (also
                when a racing unload took the name first).
        """
        rec = self.get(self.lookup(token))
        if token not in rec.names:  # an id
            return NameRemoval(self.unregister(rec.id), unregistered=True)

        last_name = False  # ``token`` was the adapter's name and it had no alias

        def drop(current: AdapterRecord, _records: list[AdapterRecord]) -> tuple[str, tuple[str, ...]]:
            nonlocal last_name
            if token in current.aliases:
                return current.name, tuple(a for a in current.aliases if a != token)
            if token == current.name:  # its oldest alias becomes its name, or none is left
                last_name = not current.aliases
                return (current.aliases[0], current.aliases[1:]) if current.aliases else ("", ())
            raise NotFoundError(f"no adapter is named '{token}' (adapter {current.id} lost it meanwhile)")

        # The name goes in the serialised name transaction; the adapter goes only if no name is
        # left then, and only if none was given to it since (an alias load racing this unload
        # answered 200 "alias of adapter N": N must stay and serve it).
        updated = self.store.set_names(rec.id, drop)
        if updated is None:
            raise NotFoundError(f"adapter {rec.id} was unregistered meanwhile")
        if last_name:
            removed = self.store.delete(rec.id, only_if_nameless=True)
            if removed is not None:
                log.info("adapter_unregistered", adapter_id=rec.id, sha256=removed.sha256)
                return NameRemoval(removed, unregistered=True)
            now = self.store.get(rec.id)
            if now is None:
                raise NotFoundError(f"adapter {rec.id} was unregistered meanwhile")
            updated = now
        log.info("adapter_name_removed", adapter_id=rec.id, name=token, now_named=updated.name)
        return NameRemoval(updated, unregistered=False)

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

    def set_default_set(self, scales: Mapping[int, float]) -> AdapterVector:
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
