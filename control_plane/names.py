"""Adapter names and aliases: which names may be given, what a token names, and changing names.

`AdapterNames` (the registry's ``names``) resolves a token to an adapter id (`lookup`, the
rule every API shares: `resolution.find_adapter`), refuses names that would shadow the base
model or an id (`name_clash`), gives a just-registered adapter its requested name (`claim`),
adds a name to known content as an alias (`add`), and drops one name, its oldest alias taking
over (`drop`). Every change runs in the store's serialised name transaction
(`AdapterStore.set_names`), so concurrent callers on any replica see one order. The why
(vLLM's load/unload semantics, names as metadata rather than keys): docs/architecture.md,
"Adapter names", and docs/http-api.md.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from control_plane.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, UnavailableError, echo
from control_plane.resolution import ID_PREFIX, find_adapter, is_id_token
from control_plane.store import AdapterRecord, AdapterStore
from loraplane.limits import MAX_ADAPTER_NAME_BYTES

log = structlog.get_logger("loraplane.control_plane.names")

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
class NameRemoval:
    """Outcome of `AdapterRegistry.unload_name`: the record as it is now (as it was, when
    ``unregistered``), and whether the adapter itself was unregistered."""

    record: AdapterRecord
    unregistered: bool


class AdapterNames:
    """The names and aliases of the adapters in ``store``.

    Args:
        store: the adapter rows; names change only through `AdapterStore.set_names`.
        base_name: the served base-model name (`served_base_name`); a requested adapter name
            that would shadow it is refused (INVALID_ARGUMENT, `name_clash`), a clashing name
            embedded in a file is dropped (the adapter is served as ``adapter:<id>``).
    """

    def __init__(self, store: AdapterStore, base_name: str | None = None) -> None:
        self.store = store
        self.base_name = base_name

    # -- reads --------------------------------------------------------------------------

    def lookup(self, token: str) -> int:
        """The id ``token`` names: ASCII digits or ``adapter:<id>`` an id, anything else a name
        or alias (`resolution.find_adapter`, the rule every API shares).

        Raises:
            NotFoundError / AmbiguousNameError: see `resolution.find_adapter`.
        """
        return find_adapter(token, self.store.list())

    def owners(self, name: str) -> list[int]:
        """Ids of the adapters that answer to ``name`` (as name or alias)."""
        return [r.id for r in self.store.list() if name in r.names]

    # -- rules --------------------------------------------------------------------------

    def check(self, name: str) -> None:
        """Refuse a requested adapter name that would shadow the base model or an id
        (`name_clash`); "" (no name: the file's own) passes.

        Raises:
            InvalidArgumentError: the clash, named.
        """
        problem = name_clash(name, self.base_name) if name else None
        if problem:
            raise InvalidArgumentError(problem)

    def embedded(self, name: str | None) -> str:
        """The name a file's own ``general.name`` gives an adapter registered without one: it,
        unless it clashes (`name_clash`: then "" and a warning; the adapter is served as
        ``adapter:<id>``)."""
        problem = name_clash(name, self.base_name) if name else None
        if problem:
            log.warning("adapter_name_dropped", name=echo(name or ""), reason=problem)
            return ""
        return name or ""

    def check_free(self, name: str) -> None:
        """Refuse a requested ``name`` an adapter already answers to ("": nothing to check).

        Raises:
            AlreadyExistsError: naming the name and the adapter(s) holding it.
        """
        owners = self.owners(name) if name else []
        if owners:
            raise AlreadyExistsError(f"adapter name '{name}' is taken by adapter(s) {owners}; pick another name")

    # -- changes ------------------------------------------------------------------------

    def claim(self, rec: AdapterRecord, name: str) -> AdapterRecord:
        """Give the just-inserted, still unnamed ``rec`` the requested ``name`` in the store's
        serialised name transaction (`AdapterStore.set_names`), so that of several callers
        (threads or replicas) registering different content under one new name at once, one
        gets it and the others fail: `check_free` ran before the insert and cannot see them.
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

    def add(self, rec: AdapterRecord, name: str) -> tuple[AdapterRecord, Literal["", "alias", "name"]]:
        """Known content ``rec`` asked for again under ``name`` (not one of its names): ``name``
        becomes an alias of it (vLLM's ``load_lora_adapter`` of the same files under a new
        ``lora_name``: the new name must serve at once), or its name when it has none yet
        (another call's insert, not claimed yet). Returns the record now and what ``name``
        became ("": another call added it meanwhile).

        Raises:
            AlreadyExistsError: another adapter answers to ``name``.
            UnavailableError: ``rec`` was unregistered meanwhile.
        """
        added: Literal["", "alias", "name"] = ""

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
        if added == "alias":
            log.info("adapter_alias_added", adapter_id=rec.id, alias=name, sha256=rec.sha256)
        elif added == "name":
            log.info("adapter_named", adapter_id=rec.id, name=name, sha256=rec.sha256)
        return updated, added

    def drop(self, rec: AdapterRecord, token: str) -> NameRemoval:
        """Drop the name ``token`` of ``rec`` (one of its names), not more:

        * an alias → that alias goes; the adapter stays (same id, other names);
        * its name, with aliases → its oldest alias becomes its name; the adapter stays, so a
          client that loaded it under another name keeps it;
        * its name and no alias → the adapter is unregistered (deleted from the store), unless
          a name was given to it meanwhile (an alias load racing this unload answered 200
          "alias of adapter N": N must stay and serve it). The caller unloads it from the
          workers.

        Raises:
            NotFoundError: ``rec`` lost ``token`` or was unregistered meanwhile.
        """
        last_name = False  # ``token`` was the adapter's name and it had no alias

        def drop_one(current: AdapterRecord, _records: list[AdapterRecord]) -> tuple[str, tuple[str, ...]]:
            nonlocal last_name
            if token in current.aliases:
                return current.name, tuple(a for a in current.aliases if a != token)
            if token == current.name:  # its oldest alias becomes its name, or none is left
                last_name = not current.aliases
                return (current.aliases[0], current.aliases[1:]) if current.aliases else ("", ())
            raise NotFoundError(f"no adapter is named '{token}' (adapter {current.id} lost it meanwhile)")

        updated = self.store.set_names(rec.id, drop_one)
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
