"""The connection to the API server: where it is, how to authenticate, and raw JSON requests over it.

The `kubernetes` package finds the server and the credentials (kubeconfig files with their exec plugins
and client certificates, or a pod's service account with its rotating token) and owns the TLS connection
pool. Requests bypass its generated models: a proxy reads three resource types, and decoding the typed
models costs about twice as long as `json.loads` of the same list (measured at 10,000 Services), which
is most of a cold start at scale. Watches are read line by line from the open response.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import urllib3
import yaml

if TYPE_CHECKING:
    from kubernetes import client as k8s_client

# `kubernetes` is imported where a connection is configured, not here: importing it costs about 0.6 s and
# 30 MB, which a pyproxy reading manifests (labs, tests, benchmarks) would pay for nothing.

log = logging.getLogger(__name__)

# A pod's service account, as kubelet mounts it.
_SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
# Three watch streams stay open all the time, plus a list, an event or a discovery request beside them.
_POOL_SIZE = 8


class ConfigError(RuntimeError):
    """No usable API server configuration; the message says which input is wrong."""


class ApiError(RuntimeError):
    """The API server answered with an error status; `status` is the HTTP status (or the watch's
    Status code), `reason` the server's message."""

    def __init__(self, status: int, reason: str, path: str) -> None:
        super().__init__(f"{path}: {status} {reason}")
        self.status = status
        self.reason = reason


@dataclass
class ConnectionSettings:
    kubeconfig: Path | None = None
    """--kubeconfig: a kubeconfig file; its current context names the server and the credentials."""
    master: str | None = None
    """--master: the API server's URL; overrides the kubeconfig's server (as upstream)."""


def in_cluster() -> bool:
    """Whether this process runs in a pod with a service account (upstream's in-cluster test)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and _SA_TOKEN.exists()


def configuration(settings: ConnectionSettings) -> k8s_client.Configuration:
    """The client configuration: kubeconfig and/or master if given, else the pod's service account."""
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    cfg = k8s_client.Configuration()
    if settings.kubeconfig is not None:
        if not settings.kubeconfig.is_file():
            raise ConfigError(f"--kubeconfig {settings.kubeconfig}: no such file")
        try:
            k8s_config.load_kube_config(config_file=str(settings.kubeconfig), client_configuration=cfg)
        except (k8s_config.ConfigException, ValueError, TypeError, OSError, yaml.YAMLError) as e:
            raise ConfigError(f"--kubeconfig {settings.kubeconfig}: {e}") from e
    elif settings.master is None:
        if not in_cluster():
            raise ConfigError(
                "no API server: give --kubeconfig or --master, run in a pod with a service account, "
                "or read manifests with --source"
            )
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)
        except k8s_config.ConfigException as e:
            raise ConfigError(f"in-cluster configuration: {e}") from e
    if settings.master is not None:
        if not settings.master.startswith(("http://", "https://")):
            raise ConfigError(f"--master {settings.master!r}: want an http:// or https:// URL")
        cfg.host = host = settings.master.rstrip("/")
        # The kubeconfig loader's token refresh re-applies the whole kubeconfig, server included, before every
        # request: re-assert --master after it, or the override would last until the first request.
        reload_kubeconfig = cfg.refresh_api_key_hook
        if reload_kubeconfig is not None:

            def refresh(c: k8s_client.Configuration) -> None:
                reload_kubeconfig(c)
                c.host = host

            cfg.refresh_api_key_hook = refresh
    cfg.connection_pool_maxsize = _POOL_SIZE
    return cfg


class ApiClient:
    """GET/POST of JSON and watch streams against one API server."""

    def __init__(self, cfg: k8s_client.Configuration, connect_timeout: float = 10.0) -> None:
        from kubernetes import client as k8s_client

        self._api = k8s_client.ApiClient(cfg)
        self._api.user_agent = "pyproxy"
        self.connect_timeout = connect_timeout

    @property
    def host(self) -> str:
        return str(self._api.configuration.host)

    def _open(
        self, method: str, path: str, query: Mapping[str, Any] | None, body: Any, read_timeout: float
    ) -> urllib3.BaseHTTPResponse:
        # param_serialize adds the credentials (refreshing a rotating token when due) and the URL.
        _, url, headers, body, _ = self._api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        rest = self._api.call_api(
            method, url, header_params=headers, body=body, _request_timeout=(self.connect_timeout, read_timeout)
        )
        response: urllib3.BaseHTTPResponse = rest.response
        if response.status >= 400:
            try:
                reason = _status_message(json.loads(response.data), response.reason or "")
            except ValueError:
                reason = response.reason or ""
            finally:
                response.release_conn()
            raise ApiError(response.status, reason, path)
        return response

    def request(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        read_timeout: float = 60.0,
    ) -> dict[str, Any]:
        """One request; the decoded JSON answer. Raises ApiError for an error status, and urllib3's
        errors when the server cannot be reached."""
        response = self._open(method, path, query, body, read_timeout)
        try:
            decoded: dict[str, Any] = json.loads(response.data)
        finally:
            response.release_conn()
        return decoded

    def stream(
        self, path: str, query: Mapping[str, Any], read_timeout: float
    ) -> tuple[urllib3.BaseHTTPResponse, Iterator[dict[str, Any]]]:
        """A watch: the open response (close it to end the watch from another thread) and its events.
        A read timeout means no line arrived for `read_timeout` seconds."""
        response = self._open("GET", path, query, None, read_timeout)

        def events() -> Iterator[dict[str, Any]]:
            try:
                for line in _lines(response):
                    event: dict[str, Any] = json.loads(line)
                    yield event
            finally:
                response.release_conn()

        return response, events()

    def close(self) -> None:
        self._api.close()


def _lines(response: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """Newline-separated lines of a streamed body; a watch sends one JSON event per line."""
    pending = b""
    for chunk in response.stream(64 * 1024, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (line for line in lines if line.strip())
    if pending.strip():
        yield pending


def _status_message(body: Any, default: str) -> str:
    if isinstance(body, Mapping) and isinstance(body.get("message"), str):
        return str(body["message"])
    return default
