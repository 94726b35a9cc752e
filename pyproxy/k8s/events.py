"""Events about the node, as upstream kube-proxy records "Starting kube-proxy." on start."""

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
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{node}.", "namespace": "default"},
        # A node's UID is not needed to find its events; upstream uses the name there too.
        "involvedObject": {"kind": "Node", "name": node, "uid": node, "apiVersion": "v1"},
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
        api.request("POST", "/api/v1/namespaces/default/events", body=body, read_timeout=10.0)
    except (ApiError, urllib3.exceptions.HTTPError, OSError) as e:
        log.warning("cannot record event %s for node %s: %s", reason, node, e)
        return False
    return True
