"""A source that reads Services and EndpointSlices from manifest files, for labs and tests, and the Node pyproxy
runs on when one of them holds it (its zone label feeds topology-aware routing; other Nodes are ignored).

It polls a file or a folder and pushes only what changed into a sink. Operators edit these files by
hand, so bad input must never cost them what already works: a file that does not parse keeps its
previous objects, an invalid object keeps its previous version, and everything else still applies.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pyproxy.k8s.convert import (
    ENDPOINT_SLICE_KIND,
    NODE_KIND,
    SERVICE_KIND,
    endpointslice_from_dict,
    node_from_dict,
    service_from_dict,
)
from pyproxy.k8s.sink import ObjectSink
from pyproxy.model.objects import EndpointSlice, InvalidObject, Node, Service

log = logging.getLogger(__name__)

# Editors' temporary files (`x~`, `*.swp`, `#x.yaml#`) fail this test; lock files (`.#x`) are hidden.
_SUFFIXES = frozenset({".yaml", ".yml", ".json"})
_SLICE_API_VERSIONS = ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1")

_Object = Service | EndpointSlice | Node
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
    if kind == NODE_KIND and api_version == "v1":
        return node_from_dict
    return None


# What one decoded document became: a model object (with its kind), an InvalidObject, a document that is no
# object at all, or an object of a kind pyproxy ignores ((apiVersion, kind)).
_Outcome = tuple[str, Any]
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _skip_space(text: str, idx: int) -> int:
    match = _SPACE.match(text, idx)
    return match.end() if match else idx


def _convert(doc: Any) -> _Outcome:
    if not isinstance(doc, Mapping):
        return "not an object", doc
    convert = _converter(doc)
    if convert is None:
        return "ignored", (doc.get("apiVersion"), doc.get("kind"))
    try:
        return "object", (doc["kind"], convert(doc))
    except InvalidObject as e:
        return "invalid", e


def _flatten(docs: list[Any]) -> Iterator[Any]:
    """The objects of the documents, with `kind: List` (or any `*List`) replaced by its items. Each one is
    dropped from `docs` as it is handed out, so the decoded documents shrink while their objects are
    converted."""
    for i, doc in enumerate(docs):
        docs[i] = None
        kind = doc.get("kind") if isinstance(doc, Mapping) else None
        if isinstance(kind, str) and kind.endswith("List") and isinstance(doc.get("items"), list):
            yield from _flatten(doc["items"])
        elif doc is not None:  # None: an empty YAML document
            yield doc


def _json_list(text: str) -> list[_Outcome] | None:
    """The outcomes of a JSON document that is one `kind: *List` object whose kind comes before its items,
    each item decoded and converted on its own: the whole decoded document is never in memory (at 10,000
    Services it weighs ~75 MB, for an 11 MB file, beside the model built from it). None for any other shape
    or anything unexpected (a duplicate kind or items, a syntax error): the caller then decodes the whole
    document as json.loads does, with its error messages."""
    space = _skip_space
    idx = space(text, 0)
    if not text.startswith("{", idx):
        return None
    idx = space(text, idx + 1)
    kind: Any = None
    outcomes: list[_Outcome] | None = None
    while text.startswith('"', idx):
        key, idx = _DECODER.raw_decode(text, idx)
        idx = space(text, idx)
        if not text.startswith(":", idx):
            return None
        idx = space(text, idx + 1)
        if key in ("kind", "items") and outcomes is not None:
            return None  # the last of duplicate keys wins in json.loads: let it decide
        if key == "items" and isinstance(kind, str) and kind.endswith("List") and text.startswith("[", idx):
            outcomes, idx = [], space(text, idx + 1)
            while not text.startswith("]", idx):
                item, idx = _DECODER.raw_decode(text, idx)
                outcomes.extend(_convert(doc) for doc in _flatten([item]))
                idx = space(text, idx)
                if text.startswith(",", idx):
                    idx = space(text, idx + 1)
                elif not text.startswith("]", idx):
                    return None
            idx += 1
        else:
            value, idx = _DECODER.raw_decode(text, idx)
            if key == "kind":
                kind = value
        idx = space(text, idx)
        if text.startswith(",", idx):
            idx = space(text, idx + 1)
        elif text.startswith("}", idx):
            return outcomes if space(text, idx + 1) == len(text) else None
        else:
            return None
    return None


def _parse(path: Path) -> list[_Outcome]:
    """What each object of a file became; raises OSError, ValueError, RecursionError (absurd nesting) or
    yaml.YAMLError when the file does not parse, having logged nothing about its objects."""
    with path.open(encoding="utf-8") as f:
        if path.suffix != ".json":
            return [_convert(doc) for doc in _flatten(list(yaml.safe_load_all(f)))]
        text = f.read()
    try:
        streamed = _json_list(text)
    except ValueError:
        streamed = None  # json.loads below raises it again, with its own message
    return streamed if streamed is not None else [_convert(doc) for doc in _flatten([json.loads(text)])]


def _read(path: Path, previous: Mapping[_ObjectId, _Object]) -> dict[_ObjectId, _Object]:
    """The objects of one file; where the file or an object is bad, the `previous` ones stay."""
    try:
        outcomes = _parse(path)
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as e:
        log.error("%s: cannot read%s: %s", path, "; keeping its previous objects" if previous else "", e)
        return dict(previous)
    objects: dict[_ObjectId, _Object] = {}
    for what, outcome in outcomes:
        if what == "not an object":
            log.error("%s: skipping a document that is not an object: %.80r", path, outcome)
        elif what == "ignored":
            log.debug("%s: ignoring %s %s", path, *outcome)
        elif what == "invalid":
            kept = previous.get((outcome.kind, outcome.key))
            log.error(
                "%s: invalid %s %s: %s%s",
                path,
                outcome.kind,
                outcome.key,
                outcome.reason,
                "; keeping its previous version" if kept is not None else "",
            )
            if kept is not None:
                objects.setdefault((outcome.kind, outcome.key), kept)
        else:
            kind, obj = outcome
            oid = (kind, obj.key)
            for why in getattr(obj, "ignored", ()):
                log.warning("%s: %s %s: ignoring %s", path, kind, obj.key, why)
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
    """Polls `path` (a file, or a folder read recursively) and keeps `sink` in step with it; of the Nodes, only
    the one named `node_name` is delivered."""

    def __init__(self, path: Path, sink: ObjectSink, poll_interval: float = 0.2, node_name: str | None = None) -> None:
        self.path = path
        self.sink = sink
        self.poll_interval = poll_interval
        self.node_name = node_name
        self._files: dict[Path, _File] = {}
        self._services: dict[str, Service] = {}
        self._slices: dict[str, EndpointSlice] = {}
        self._node: Node | None = None
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
        found = merged.get((NODE_KIND, self.node_name or ""))
        node = found if isinstance(found, Node) else None
        _push_changes(self._services, services, self.sink.set_service)
        _push_changes(self._slices, slices, self.sink.set_endpoint_slice)
        if node != self._node:
            self.sink.set_node(node)
        self._services, self._slices, self._node = services, slices, node

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
