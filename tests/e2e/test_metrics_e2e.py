"""/metrics and the log of a running pyproxy in bpf mode, with real traffic: the per-Service counters and the
datapath counters go up by what was sent, upstream's series are there, and --logging-format=json writes JSON
lines an operator greps for."""

from __future__ import annotations

import json

import pytest
from scenarios import DNS_IP, WEB_IP, all_ready, dns, start_web_and_dns, web

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


def _endpoint_series(m: dict[str, float], service: str, port: str) -> dict[str, tuple[float, float]]:
    """endpoint -> (packets, bytes) of one Service port's pyproxy_endpoint_* series."""
    out: dict[str, tuple[float, float]] = {}
    for key, value in m.items():
        if not key.startswith("pyproxy_endpoint_packets_total{"):
            continue
        labels = dict(kv.split("=", 1) for kv in key[key.index("{") + 1:-1].split(","))
        if (labels["namespace"], labels["service"], labels["port"]) == ("default", service, port):
            out[labels["endpoint"]] = (value, m[key.replace("_packets_total", "_bytes_total")])
    return out


def _settled(env) -> dict[str, float]:
    """A scrape once two in a row agree on the Services' counters: a connection's last ACK may still be on its way
    when the probe returns."""
    last = env.metrics()
    for _ in range(100):
        m = env.metrics()
        if all(m.get(k) == last.get(k) for k in m if k.startswith("pyproxy_service_")):
            return m
        last = m
    raise AssertionError("the Services' counters kept moving with no traffic sent")


def test_endpoint_counters_count_exactly_the_endpoints_that_served(make_env) -> None:
    env = make_env(3)
    b1, b2, b3 = env.lab.backends[:3]
    env.write("web.yaml", *web(all_ready(env)))
    env.write("dns.yaml", *dns({b1.ip: True, b2.ip: True, b3.ip: False}))  # b3:5353 an endpoint that serves nothing
    env.start(args=["--bpf-endpoint-counters"])
    assert _endpoint_series(env.metrics(), "dns", "dns") == {}, "no series before any traffic"
    ips = {b.name: b.ip for b in env.lab.backends}

    n = 40
    udp = env.probe("udp", DNS_IP, 53, n)
    assert udp["failures"] == 0
    m = _settled(env)
    served = {f"{ips[name.split(':')[0]]}:5353": count for name, count in udp["replies"].items()}
    # One datagram per probe: each endpoint counted exactly the probes it answered, and only those that answered.
    assert _endpoint_series(m, "dns", "dns") == {ep: (count, count * UDP_FRAME) for ep, count in served.items()}
    assert f"{b3.ip}:5353" not in served

    tcp = env.probe("tcp", WEB_IP, 80, n)
    assert tcp["failures"] == 0
    m = _settled(env)
    web_eps = _endpoint_series(m, "web", "http")
    assert set(web_eps) == {f"{ips[name.split(':')[0]]}:8080" for name in tcp["replies"]}
    for name, count in tcp["replies"].items():  # SYN, the handshake's ACK, the request, the close
        assert web_eps[f"{ips[name.split(':')[0]]}:8080"][0] >= 3 * count
    # The Service's counter is the sum of its endpoints' (each packet is counted once in each, at the same place).
    for service, labels in (("web", WEB), ("dns", DNS)):
        eps = _endpoint_series(m, service, labels.split("port=")[1].split(",")[0])
        assert sum(p for p, _ in eps.values()) == m[f"pyproxy_service_packets_total{{{labels}}}"]
        assert sum(b for _, b in eps.values()) == m[f"pyproxy_service_bytes_total{{{labels}}}"]


def test_endpoint_counts_survive_a_restart_and_go_with_the_endpoint(make_env) -> None:
    env = make_env(2)
    b1, b2 = env.lab.backends[:2]
    env.write("dns.yaml", *dns({b1.ip: True, b2.ip: True}))
    env.start(args=["--bpf-endpoint-counters"])
    assert env.probe("udp", DNS_IP, 53, 40)["failures"] == 0
    counted = _endpoint_series(_settled(env), "dns", "dns")
    assert set(counted) == {f"{b1.ip}:5353", f"{b2.ip}:5353"}

    assert env.running.terminate() == 0
    env.start(args=["--bpf-endpoint-counters"])
    assert _endpoint_series(env.metrics(), "dns", "dns") == counted, "the pinned map kept every count"

    env.write("dns.yaml", *dns({b1.ip: True}))  # b2:5353 leaves its only Service
    gone = env.poll(lambda: f"{b2.ip}:5353" not in _endpoint_series(env.metrics(), "dns", "dns"), deadline=10.0)
    assert gone is not None, "b2's series stayed after it left every Service"
    assert _endpoint_series(env.metrics(), "dns", "dns") == {f"{b1.ip}:5353": counted[f"{b1.ip}:5353"]}
