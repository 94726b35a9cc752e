"""A source that reads Services and EndpointSlices from manifest files, for labs and tests.

It polls a file or a folder and pushes only what changed into a sink. Operators edit these files by
hand, so bad input must never cost them what already works: a file that does not parse keeps its
previous objects, an invalid object keeps its previous version, and everything else still applies.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pyproxy.k8s.convert import ENDPOINT_SLICE_KIND, SERVICE_KIND, endpointslice_from_dict, service_from_dict
from pyproxy.k8s.sink import ObjectSink
from pyproxy.model.objects import EndpointSlice, InvalidObject, Service

log = logging.getLogger(__name__)

# Editors' temporary files (`x~`, `*.swp`, `#x.yaml#`) fail this test; lock files (`.#x`) are hidden.
_SUFFIXES = frozenset({".yaml", ".yml", ".json"})
_SLICE_API_VERSIONS = ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1")

_Object = Service | EndpointSlice
_ObjectId = tuple[str, str]
"""(kind, namespace/name)"""
T = TypeVar("T")


@dataclass(slots=True)
class _File:
    signature: tuple[int, int, int]
    """(mtime_ns, size, inode): any write or replacement changes it."""
    objects: dict[_ObjectId, _Object]
    """The file's good objects, or the last good ones where it is broken."""


def _converter(obj: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], _Object] | None:
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if kind == SERVICE_KIND and api_version == "v1":
        return service_from_dict
    if kind == ENDPOINT_SLICE_KIND and api_version in _SLICE_API_VERSIONS:
        return endpointslice_from_dict
    return None


def _parse(path: Path) -> list[Any]:
    """The documents of a file; raises OSError, ValueError, RecursionError (absurd nesting) or
    yaml.YAMLError."""
    with path.open(encoding="utf-8") as f:
        if path.suffix == ".json":
            return [json.load(f)]
        return list(yaml.safe_load_all(f))


def _flatten(docs: Iterable[Any]) -> Iterator[Any]:
    """The objects of the documents, with `kind: List` (or any `*List`) replaced by its items."""
    for doc in docs:
        kind = doc.get("kind") if isinstance(doc, Mapping) else None
        if isinstance(kind, str) and kind.endswith("List") and isinstance(doc.get("items"), list):
            yield from _flatten(doc["items"])
        elif doc is not None:  # None: an empty YAML document
            yield doc


def _read(path: Path, previous: Mapping[_ObjectId, _Object]) -> dict[_ObjectId, _Object]:
    """The objects of one file; where the file or an object is bad, the `previous` ones stay."""
    try:
        docs = _parse(path)
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as e:
        log.error("%s: cannot read%s: %s", path, "; keeping its previous objects" if previous else "", e)
        return dict(previous)
    objects: dict[_ObjectId, _Object] = {}
    for doc in _flatten(docs):
        if not isinstance(doc, Mapping):
            log.error("%s: skipping a document that is not an object: %.80r", path, doc)
            continue
        convert = _converter(doc)
        if convert is None:
            log.debug("%s: ignoring %s %s", path, doc.get("apiVersion"), doc.get("kind"))
            continue
        try:
            obj = convert(doc)
        except InvalidObject as e:
            kept = previous.get((e.kind, e.key))
            log.error(
                "%s: invalid %s %s: %s%s",
                path,
                e.kind,
                e.key,
                e.reason,
                "; keeping its previous version" if kept is not None else "",
            )
            if kept is not None:
                objects.setdefault((e.kind, e.key), kept)
            continue
        oid = (doc["kind"], obj.key)
        if oid in objects:
            log.warning("%s: %s %s is defined twice; the later one wins", path, *oid)
        objects[oid] = obj
    return objects


def _push_changes(old: Mapping[str, T], new: Mapping[str, T], push: Callable[[str, T | None], None]) -> None:
    for key in sorted(old.keys() - new.keys()):
        push(key, None)
    for key, obj in new.items():
        if old.get(key) != obj:
            push(key, obj)


class ManifestSource:
    """Polls `path` (a file, or a folder read recursively) and keeps `sink` in step with it."""

    def __init__(self, path: Path, sink: ObjectSink, poll_interval: float = 0.2) -> None:
        self.path = path
        self.sink = sink
        self.poll_interval = poll_interval
        self._files: dict[Path, _File] = {}
        self._services: dict[str, Service] = {}
        self._slices: dict[str, EndpointSlice] = {}
        self._synced = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _list(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]  # named explicitly: read whatever its suffix
        files: list[Path] = []
        for root, dirs, names in os.walk(self.path):
            # Skipping hidden entries also skips a ConfigMap volume's `..data` and `..<timestamp>`
            # folders, whose files the visible symlinks already lead to.
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files.extend(
                Path(root, n) for n in names if not n.startswith(".") and Path(n).suffix in _SUFFIXES
            )
        return files

    def load_once(self) -> None:
        """Read what changed since the last call and push the differences into the sink; the first
        call also marks the sink synced. Bad input is logged, never raised."""
        if not self._synced and not self.path.exists():
            log.warning("%s does not exist; no manifests until it does", self.path)
        changed = False
        listed: set[Path] = set()
        for path in self._list():
            try:
                st = path.stat()
            except FileNotFoundError:  # removed since listed, or a dangling symlink
                continue
            listed.add(path)
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
            known = self._files.get(path)
            if known is None or known.signature != signature:
                self._files[path] = _File(signature, _read(path, known.objects if known else {}))
                changed = True
        for path in self._files.keys() - listed:
            del self._files[path]
            changed = True
        if changed:
            self._apply()
        if not self._synced:
            self.sink.mark_synced()
            self._synced = True

    def _apply(self) -> None:
        merged: dict[_ObjectId, _Object] = {}
        origin: dict[_ObjectId, Path] = {}
        for path in sorted(self._files):
            for oid, obj in self._files[path].objects.items():
                if oid in origin:
                    log.warning("%s %s is in both %s and %s; using %s", *oid, origin[oid], path, path)
                merged[oid] = obj
                origin[oid] = path
        services = {key: o for (_, key), o in merged.items() if isinstance(o, Service)}
        slices = {key: o for (_, key), o in merged.items() if isinstance(o, EndpointSlice)}
        _push_changes(self._services, services, self.sink.set_service)
        _push_changes(self._slices, slices, self.sink.set_endpoint_slice)
        self._services, self._slices = services, slices

    def run(self, stop: threading.Event) -> None:
        """Poll until `stop` is set."""
        while not stop.is_set():
            try:
                self.load_once()
            except Exception:
                # Not bad input (that is handled) but a bug or a failing sink: keep polling.
                log.exception("reading manifests from %s failed", self.path)
            stop.wait(self.poll_interval)

    def start(self) -> threading.Thread:
        """Run in a daemon thread until `stop()`."""
        self._stop.clear()
        self._thread = threading.Thread(
            target=self.run, args=(self._stop,), name="manifest-source", daemon=True
        )
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop the thread started by `start()` and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
