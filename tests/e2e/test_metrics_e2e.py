"""/metrics and the log of a running pyproxy in bpf mode, with real traffic: the per-Service counters and the
datapath counters go up by what was sent, upstream's series are there, and --logging-format=json writes JSON
lines an operator greps for."""

from __future__ import annotations

import json

import pytest
from scenarios import DNS_IP, WEB_IP, start_web_and_dns

from pyproxy.dataplane.bpf import abi

pytestmark = pytest.mark.root

DNS = "frontend=10.96.0.53:53/UDP,namespace=default,port=dns,service=dns"
WEB = "frontend=10.96.0.10:80/TCP,namespace=default,port=http,service=web"
# A probe's datagram ("probe\n") as the node's device has it: 14 (Ethernet) + 20 (IP) + 8 (UDP) + 6.
UDP_FRAME = 48


def _event(m: dict[str, float], name: str) -> float:
    return m[f"pyproxy_bpf_datapath_events_total{{event={name}}}"]


def test_service_and_datapath_counters_go_up_by_the_traffic_sent(make_env) -> None:
    env = make_env(3)
    start_web_and_dns(env)
    before = env.metrics()
    n = 40
    assert env.probe("udp", DNS_IP, 53, n)["failures"] == 0
    after = env.metrics()
    packets, octets = (after[f"pyproxy_service_{k}_total{{{DNS}}}"] - before[f"pyproxy_service_{k}_total{{{DNS}}}"]
                       for k in ("packets", "bytes"))
    assert packets == n, "one datagram per probe, each counted once"
    assert octets == n * UDP_FRAME
    assert _event(after, "new_flow") - _event(before, "new_flow") == n, "each probe is a new flow (a fresh port)"
    assert _event(after, "revnat") - _event(before, "revnat") == n, "each reply reverse-translated"
    assert after[f"pyproxy_service_packets_total{{{WEB}}}"] == before[f"pyproxy_service_packets_total{{{WEB}}}"]

    assert env.probe("tcp", WEB_IP, 80, n)["failures"] == 0
    tcp = env.metrics()
    web_packets = tcp[f"pyproxy_service_packets_total{{{WEB}}}"] - after[f"pyproxy_service_packets_total{{{WEB}}}"]
    # SYN, the handshake's ACK, the request, and the close: at least 3 client packets a connection.
    assert web_packets >= 3 * n
    assert _event(tcp, "new_flow") - _event(after, "new_flow") == n
    assert _event(tcp, "established") - _event(after, "established") >= 2 * n
    assert tcp[f"pyproxy_service_packets_total{{{DNS}}}"] == after[f"pyproxy_service_packets_total{{{DNS}}}"]

    # Map occupancy and upstream's series, as a scrape shows them.
    assert tcp[f"pyproxy_bpf_map_entries{{map={abi.MAP_SERVICES}}}"] == 2, "one services-map entry per frontend"
    assert tcp["kubeproxy_proxy_healthz_total{code=200}"] >= 1
    assert tcp["kubeproxy_sync_full_proxy_rules_duration_seconds_count"] >= 1
    assert tcp["kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"] > 0
    assert tcp["kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=external}"] == 0
    log = env.running.log_text()
    assert "Using bpf Proxier" in log
    assert "SyncProxyRules complete elapsed=" in log


def test_json_logs_are_one_object_a_line_with_upstreams_keys(make_env) -> None:
    env = make_env(2)
    start_web_and_dns(env, args=["--logging-format=json"])
    # The lab's own lines ("### command") aside, every line is a JSON object.
    lines = [json.loads(line) for line in env.running.log_text().splitlines() if line.strip() and
             not line.startswith("###")]
    using = [line for line in lines if line["msg"] == "Using bpf Proxier"]
    assert len(using) == 1 and using[0]["v"] == 0 and isinstance(using[0]["ts"], float)
    sync = next(line for line in lines if line["msg"] == "SyncProxyRules complete")
    assert sync["v"] == 2 and sync["fullSync"] is True and sync["services"] == 2
    assert sync["elapsed"].endswith("ms") and sync["caller"].startswith("proxier.py:")
