"""Events: about the node, as upstream kube-proxy records "Starting kube-proxy." on start, and about a Service
pyproxy cannot program (a full BPF map)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import urllib3

from pyproxy.k8s.client import ApiClient, ApiError

log = logging.getLogger(__name__)

COMPONENT = "pyproxy"


def record_node_event(api: ApiClient, node: str, reason: str, message: str, event_type: str = "Normal") -> bool:
    """Create a core/v1 Event about `node` in the default namespace (where `kubectl describe node` looks
    for node events). Best effort: an event is informational, so failure is logged and returns False."""
    # A node's UID is not needed to find its events; upstream uses the name there too.
    return _record(api, node, {"kind": "Node", "name": node, "uid": node, "apiVersion": "v1"}, "default", reason,
                   message, event_type)


def record_service_event(api: ApiClient, node: str, service: str, reason: str, message: str,
                         event_type: str = "Warning") -> bool:
    """Create a core/v1 Event about the Service `service` ("namespace/name") in its namespace, where `kubectl
    describe service` shows it, from pyproxy on `node`. Best effort, as record_node_event."""
    namespace, name = service.split("/", 1)
    return _record(api, node, {"kind": "Service", "namespace": namespace, "name": name, "apiVersion": "v1"},
                   namespace, reason, message, event_type)


def _record(api: ApiClient, node: str, involved: dict[str, str], namespace: str, reason: str, message: str,
            event_type: str) -> bool:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message,
        "type": event_type,
        "source": {"component": COMPONENT, "host": node},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
    }
    try:
        api.request("POST", f"/api/v1/namespaces/{namespace}/events", body=body, read_timeout=10.0)
    except (ApiError, urllib3.exceptions.HTTPError, OSError) as e:
        log.warning("cannot record event %s for %s %s: %s", reason, involved["kind"], involved["name"], e)
        return False
    return True
