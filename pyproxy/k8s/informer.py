"""Informers: Services, EndpointSlices and the own Node, from the API server into an ObjectSink.

One reflector per resource lists, then watches from the list's resourceVersion, as client-go's
reflector does, and hands every object it sees to the sink, which drops no-op updates. What an operator
relies on:

- Nothing is lost or duplicated. A relist (first start, or a watch whose resourceVersion expired: 410
  Gone after etcd compaction or an API server restart) is reconciled against the keys already delivered:
  keys the list lacks are deleted, everything else is delivered again and the trackers drop what did not
  change. The sink therefore ends at exactly the API's state, not at a union of old and new.
- The last good state stays while the API server is unreachable: errors only delay, they never deliver
  deletions. Connection errors back off exponentially with jitter (so a restarted API server is not hit by
  every node at once) and retry the watch from the last resourceVersion, which avoids a relist when the
  server comes back with its history intact.
- Objects the proxy cannot serve (a slice without its service label, an address that does not parse) are
  skipped with a warning naming namespace/name, as if absent, and the rest applies. The API server
  validated them, so there is no "previous good version" to prefer, unlike hand-edited manifests.
- A quiet watch is re-opened after `idle_timeout` without a line, so a server that vanished without
  closing the connection is noticed.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import urllib3

from pyproxy.k8s.client import ApiClient, ApiError
from pyproxy.k8s.convert import endpointslice_from_dict, node_from_dict, service_from_dict
from pyproxy.k8s.sink import ObjectSink
from pyproxy.model.objects import InvalidObject, object_key

log = logging.getLogger(__name__)

T = TypeVar("T")

# As upstream kube-proxy: Services and slices that name another proxy, or belong to headless Services,
# are none of ours, and the server filters them out.
PROXY_LABEL_SELECTOR = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
SLICE_GROUP = "discovery.k8s.io"
# Preferred first: v1 (Kubernetes 1.21+), else v1beta1 (1.17 to 1.24).
SLICE_VERSIONS = ("v1", "v1beta1")
LIST_PAGE_SIZE = 500
# Server-side watch lifetime, randomised like client-go's (5 to 10 minutes) so that the watches of many
# nodes do not all end and reopen together.
WATCH_SECONDS = (300, 600)

_CONNECTION_ERRORS = (urllib3.exceptions.HTTPError, OSError, ValueError)
"""Unreachable, reset, timed out, or a torn response (ValueError: a truncated JSON line)."""


class Expired(Exception):
    """The resourceVersion to watch from is no longer available (410 Gone): relist."""


def _counter(help_text: str) -> Any:
    return field(default=0, metadata={"help": help_text})


@dataclass
class ReflectorStats:
    """What one reflector has done, for metrics (each field's help is its metric's help) and tests."""

    lists: int = _counter("Complete lists delivered to the proxier: the first and every relist")
    expired: int = _counter("Relists forced by an expired resourceVersion (410 Gone)")
    watches: int = _counter("Watch requests opened")
    errors: int = _counter("Failed requests: unreachable API server, error status, broken stream")
    events: int = _counter("Watch events received, bookmarks included")
    invalid: int = _counter("Objects skipped because they cannot be served")


class Backoff:
    """Exponential backoff with jitter: each delay is drawn from the upper half of an interval that
    doubles up to `cap`."""

    def __init__(self, initial: float = 0.5, cap: float = 30.0, rng: Callable[[], float] = random.random) -> None:
        self.initial = initial
        self.cap = cap
        self._rng = rng
        self._failures = 0

    def next(self) -> float:
        ceiling = min(self.cap, self.initial * 2**self._failures)
        self._failures += 1
        return ceiling * (0.5 + self._rng() / 2)

    def reset(self) -> None:
        self._failures = 0


@dataclass(frozen=True)
class Resource(Generic[T]):
    """How to read one resource type and where its objects go."""

    name: str
    """For logs and metrics: "services", "endpointslices", "nodes"."""
    locate: Callable[[ApiClient], tuple[str, str]]
    """-> (collection path, apiVersion); may ask the server (API discovery)."""
    convert: Callable[[Mapping[str, Any]], T]
    deliver: Callable[[str, T | None], None]
    query: Mapping[str, str] = field(default_factory=dict)
    """Label and field selectors for both list and watch."""
    namespaced: bool = True


def _key(obj: Mapping[str, Any], namespaced: bool) -> str | None:
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str) or not meta["name"]:
        return None
    namespace = meta.get("namespace") if isinstance(meta.get("namespace"), str) else ""
    return object_key(namespace or "default", meta["name"]) if namespaced else str(meta["name"])


def _resource_version(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return rv if isinstance(rv, str) else ""


class Reflector(Generic[T]):
    """List and watch one resource type forever, delivering into `resource.deliver`."""

    def __init__(
        self,
        api: ApiClient,
        resource: Resource[T],
        stop: threading.Event,
        on_listed: Callable[[], None] = lambda: None,
        backoff: Backoff | None = None,
        idle_timeout: float = 90.0,
    ) -> None:
        self.api = api
        self.resource = resource
        self.stop_event = stop
        self.on_listed = on_listed
        self.backoff = backoff or Backoff()
        self.idle_timeout = idle_timeout
        self.stats = ReflectorStats()
        self.resource_version = ""
        """The resourceVersion the sink's state corresponds to ("" before the first list)."""
        self._known: set[str] = set()
        self._warned: dict[str, str] = {}  # key -> resourceVersion of the version whose problems were logged
        self._collection = ""
        """The collection path the last list used; the watch follows the same one."""
        self._api_version = ""
        self._response: urllib3.BaseHTTPResponse | None = None
        self._lock = threading.Lock()

    # -- delivery --------------------------------------------------------------------------------

    def _convert(self, key: str, obj: Mapping[str, Any]) -> T | None:
        try:
            converted = self.resource.convert(obj)
        except InvalidObject as e:
            self.stats.invalid += 1
            self._warn_once(key, obj, [f"skipping {self.resource.name}: {e}"])
            return None
        self._warn_once(key, obj, [f"{self.resource.name} {key}: ignoring {why}"
                                   for why in getattr(converted, "ignored", ())])
        return converted

    def _warn_once(self, key: str, obj: Mapping[str, Any], lines: list[str]) -> None:
        """Logs `lines` once per version of the object, not at every relist; with none, forgets the object."""
        if not lines:
            self._warned.pop(key, None)
            return
        rv = _resource_version(obj)
        if self._warned.get(key) != rv:
            self._warned[key] = rv
            for line in lines:
                log.warning("%s", line)

    def _read(self, obj: Mapping[str, Any]) -> tuple[str, T | None] | None:
        """(key, the converted object or None when it cannot be served); None without a name."""
        key = _key(obj, self.resource.namespaced)
        if key is None:
            log.warning("skipping %s without metadata.name", self.resource.name)
            return None
        if "apiVersion" not in obj:  # list items carry none; the slice converter reads the version
            obj = {**obj, "apiVersion": self._api_version}
        return key, self._convert(key, obj)

    def _upsert(self, obj: Mapping[str, Any]) -> None:
        read = self._read(obj)
        if read is not None:
            self._deliver(*read)

    def _deliver(self, key: str, converted: T | None) -> None:
        if converted is None:
            self._remove(key)
            return
        self._known.add(key)
        self.resource.deliver(key, converted)

    def _remove(self, key: str) -> None:
        if key in self._known:
            self._known.discard(key)
            self.resource.deliver(key, None)

    # -- list and watch --------------------------------------------------------------------------

    def list(self) -> str:
        """List everything, reconcile the sink with it, and return the list's resourceVersion."""
        path, self._api_version = self.resource.locate(self.api)
        self._collection = path
        # Each page is converted as it arrives, so only one page of decoded JSON is held at a time: at 10,000
        # Services the decoded items of a whole list weigh more than everything pyproxy keeps of them.
        listed: dict[str, T | None] = {}
        count = 0
        query: dict[str, Any] = {**self.resource.query, "limit": str(LIST_PAGE_SIZE)}
        while True:
            try:
                page = self.api.request("GET", path, query)
            except ApiError as e:
                if e.status != 410 or "continue" not in query:
                    raise
                # The continue token expired between pages (etcd compacted): one unpaged, consistent list.
                log.info("%s: list continuation expired; listing again in one request", self.resource.name)
                listed, count, query = {}, 0, dict(self.resource.query)
                page = self.api.request("GET", path, query)
            for obj in page.get("items") or ():
                if isinstance(obj, Mapping):
                    count += 1
                    read = self._read(obj)
                    if read is not None:
                        listed[read[0]] = read[1]
            meta = page.get("metadata") or {}
            del page
            if not meta.get("continue"):
                break
            query["continue"] = meta["continue"]
        for key in sorted(self._known - listed.keys()):
            self._remove(key)
        for key in list(self._warned.keys() - listed.keys()):
            del self._warned[key]
        for key, converted in listed.items():
            self._deliver(key, converted)
        self.stats.lists += 1
        self.resource_version = str(meta.get("resourceVersion") or "")
        log.info(
            "%s: listed %d at resourceVersion %s (%s)",
            self.resource.name, count, self.resource_version, self._api_version,
        )
        return self.resource_version

    def watch(self) -> None:
        """Follow one watch stream from `resource_version` until the server ends it or nothing arrives
        for `idle_timeout`. Raises Expired on 410."""
        path = self._collection
        seconds = random.randint(*WATCH_SECONDS)
        query = {
            **self.resource.query,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": self.resource_version,
            "timeoutSeconds": str(seconds),
        }
        self.stats.watches += 1
        response, events = self.api.stream(path, query, read_timeout=self.idle_timeout)
        with self._lock:
            self._response = response
        if self.stop_event.is_set():  # stop() ran before the response was registered
            response.shutdown()
        try:
            for event in events:
                self.stats.events += 1
                self._handle(event, path)
        except urllib3.exceptions.ReadTimeoutError:
            log.debug("%s: watch idle for %.0fs; reopening", self.resource.name, self.idle_timeout)
        finally:
            with self._lock:
                self._response = None
            response.close()

    def _handle(self, event: Mapping[str, Any], path: str) -> None:
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, Mapping):
            raise ValueError(f"{path}: watch event without an object: {event!r:.200}")
        if kind == "ERROR":
            code, message = obj.get("code"), obj.get("message", "")
            if code == 410:
                raise Expired(message)
            raise ApiError(code if isinstance(code, int) else 500, str(message), path)
        if kind in ("ADDED", "MODIFIED"):
            self._upsert(obj)
        elif kind == "DELETED":
            key = _key(obj, self.resource.namespaced)
            if key is not None:
                self._warned.pop(key, None)
                self._remove(key)
        elif kind != "BOOKMARK":
            log.debug("%s: ignoring watch event type %r", self.resource.name, kind)
            return
        # Every event moves the position forward, so a reopened watch resumes after it.
        self.resource_version = _resource_version(obj) or self.resource_version

    def run(self) -> None:
        """List and watch until the stop event is set."""
        need_list = True
        while not self.stop_event.is_set():
            try:
                if need_list:
                    self.list()
                    need_list = False
                    self.on_listed()
                self.watch()
                self.backoff.reset()
            except Expired as e:
                self.stats.expired += 1
                need_list = True
                log.info("%s: watch from resourceVersion %s expired (%s); relisting",
                         self.resource.name, self.resource_version, e)
            except ApiError as e:
                if self.stop_event.is_set():
                    break
                self.stats.errors += 1
                if e.status == 410:
                    self.stats.expired += 1
                    need_list = True
                    log.info("%s: %s; relisting", self.resource.name, e)
                    continue
                # Forbidden, a server error, a bad request: relist from scratch once the server is back.
                need_list = True
                self._pause(f"{self.resource.name}: API server error: {e}")
            except _CONNECTION_ERRORS as e:
                if self.stop_event.is_set():
                    break
                self.stats.errors += 1
                # A watch resumes from the last resourceVersion; a failed list starts over.
                self._pause(f"{self.resource.name}: cannot reach {self.api.host}: {e}")

    def _pause(self, why: str) -> None:
        delay = self.backoff.next()
        log.warning("%s; retrying in %.1fs (the dataplane keeps its state)", why, delay)
        self.stop_event.wait(delay)

    def interrupt(self) -> None:
        """Break a blocked watch read (used by stop)."""
        with self._lock:
            if self._response is not None:
                self._response.shutdown()


def slice_locator(api: ApiClient) -> tuple[str, str]:
    """The EndpointSlice collection the server serves, preferring discovery.k8s.io/v1, found by API
    discovery (asked at every list, so an upgraded cluster moves to v1 at the next relist)."""
    group = api.request("GET", f"/apis/{SLICE_GROUP}")
    served = {v.get("version") for v in group.get("versions") or () if isinstance(v, Mapping)}
    for version in SLICE_VERSIONS:
        if version in served:
            return f"/apis/{SLICE_GROUP}/{version}/endpointslices", f"{SLICE_GROUP}/{version}"
    raise ApiError(404, f"the server serves {SLICE_GROUP} only in {sorted(map(str, served))}", "/apis")


def _fixed(path: str, api_version: str) -> Callable[[ApiClient], tuple[str, str]]:
    return lambda _api: (path, api_version)


class ApiSource:
    """Keeps a sink in step with the API server: Services and EndpointSlices (marked synced once both
    have listed), and the Node named `node_name` (not awaited: a proxy works without it)."""

    def __init__(
        self,
        api: ApiClient,
        sink: ObjectSink,
        node_name: str,
        backoff_cap: float = 30.0,
        idle_timeout: float = 90.0,
    ) -> None:
        self.api = api
        self.sink = sink
        self._stop = threading.Event()
        self._pending_lists = {"services", "endpointslices"}
        self._lock = threading.Lock()
        selector = {"labelSelector": PROXY_LABEL_SELECTOR}
        resources: list[Resource[Any]] = [
            Resource("services", _fixed("/api/v1/services", "v1"), service_from_dict, sink.set_service, selector),
            Resource("endpointslices", slice_locator, endpointslice_from_dict, sink.set_endpoint_slice, selector),
            Resource(
                "nodes",
                _fixed("/api/v1/nodes", "v1"),
                node_from_dict,
                lambda _key, node: sink.set_node(node),
                {"fieldSelector": f"metadata.name={node_name}"},
                namespaced=False,
            ),
        ]
        self.reflectors = {
            r.name: Reflector(
                api, r, self._stop, self._listed_callback(r.name), Backoff(cap=backoff_cap), idle_timeout
            )
            for r in resources
        }
        self._threads: list[threading.Thread] = []

    def _listed_callback(self, name: str) -> Callable[[], None]:
        def listed() -> None:
            with self._lock:
                if name not in self._pending_lists:
                    return
                self._pending_lists.discard(name)
                done = not self._pending_lists
            if done:
                self.sink.mark_synced()

        return listed

    def start(self) -> None:
        self._stop.clear()
        for name, reflector in self.reflectors.items():
            t = threading.Thread(target=reflector.run, name=f"watch-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for reflector in self.reflectors.values():
            reflector.interrupt()
        for t in self._threads:
            t.join(timeout)
        self._threads = []
