"""Scenarios every mode's end-to-end tests share: the same Services, the same expectations, the same waits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from labkit.manifests import Port, endpoint_slice, service

WEB_IP, DNS_IP, MULTI_IP = "10.96.0.10", "10.96.0.53", "10.96.0.20"
WEB_PORTS = [Port("http", 80, 8080, target_port="http")]
DNS_PORTS = [Port("dns", 53, 5353, "UDP")]
MULTI_PORTS = [Port("http", 80, 8080), Port("admin", 90, 9090)]


def web(ready: Mapping[str, bool | None]) -> list[str]:
    return [service("web", WEB_IP, WEB_PORTS), endpoint_slice("web", ready, WEB_PORTS)]


def dns(ready: Mapping[str, bool | None]) -> list[str]:
    return [service("dns", DNS_IP, DNS_PORTS), endpoint_slice("dns", ready, DNS_PORTS)]


def names(env, port: int, backends=None) -> set[str]:
    return {f"{b.name}:{port}" for b in (env.lab.backends if backends is None else backends)}


def write_core_manifests(env) -> None:
    """Services with a not-ready endpoint, a UDP service and a two-port service; checks every answer."""
    b1, b2, b3 = env.lab.backends[:3]
    some_ready = {b1.ip: True, b2.ip: None, b3.ip: False}  # None: no conditions, which means ready
    env.write("web.yaml", *web(some_ready))
    env.write("dns.yaml", *dns(some_ready))
    env.write("multi.yaml", service("multi", MULTI_IP, MULTI_PORTS),
              endpoint_slice("multi", {b.ip: True for b in env.lab.backends}, MULTI_PORTS))


def assert_core_traffic(env) -> None:
    env.assert_reaches("tcp", WEB_IP, 80, {"b1:8080", "b2:8080"})  # b3 is not ready: it gets nothing
    env.assert_reaches("udp", DNS_IP, 53, {"b1:5353", "b2:5353"})
    env.assert_reaches("tcp", MULTI_IP, 80, names(env, 8080))  # each named port to its own target port
    env.assert_reaches("tcp", MULTI_IP, 90, names(env, 9090))
    env.assert_no_checksum_errors()


def all_ready(env) -> dict[str, bool]:
    return {b.ip: True for b in env.lab.backends}


def wait_gone(env, proto: str, ip: str, port: int, name: str, deadline: float) -> float | None:
    """Seconds until a round of 15 new flows reaches no `name` (a backend still in the set has (2/3)^15 of
    missing such a round, so the rounds are repeated until the deadline, not trusted once)."""
    return env.poll(lambda: name not in env.probe(proto, ip, port, 15)["replies"], deadline=deadline, interval=0)


def start_web_and_dns(env, **start: Any):
    """web (TCP) and dns (UDP) with every backend ready, pyproxy started (`start` as for Env.start), and every
    backend answering both; returns the Pyproxy."""
    env.write("web.yaml", *web(all_ready(env)))
    env.write("dns.yaml", *dns(all_ready(env)))
    proxy = env.start(**start)
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    env.assert_reaches("udp", DNS_IP, 53, names(env, 5353))
    return proxy


def remove_b3(env, deadline: float = 3.0) -> float | None:
    """Take b3 out of web and dns; seconds until neither new TCP connections nor new datagrams reach it (None:
    not within `deadline`). Each round is 15 of each, which a backend still in the set of three misses with a
    chance of (2/3)^15."""
    b1, b2 = env.lab.backends[:2]
    without_b3 = {b1.ip: True, b2.ip: True}
    env.write("web.yaml", *web(without_b3))
    env.write("dns.yaml", *dns(without_b3))
    tcp = wait_gone(env, "tcp", WEB_IP, 80, "b3:8080", deadline)
    udp = wait_gone(env, "udp", DNS_IP, 53, "b3:5353", deadline)
    return None if tcp is None or udp is None else max(tcp, udp)


def remove_web(env, deadline: float) -> float | None:
    """Delete the web Service's manifest; seconds until its ClusterIP stops answering (None: not within
    `deadline`). dns must keep answering from all of b1 and b2 (the caller checks what else it wants)."""
    (env.source / "web.yaml").unlink()
    gone = env.poll(lambda: not env.probe("tcp", WEB_IP, 80, 3, timeout=0.3)["replies"], deadline=deadline)
    env.assert_reaches("udp", DNS_IP, 53, {"b1:5353", "b2:5353"})  # the other Service is untouched
    return gone
