"""A BPF map too small for the cluster (--bpf-map-sizes): the Services that fit are served and stay served, the
ones that do not are logged by name once, counted by the map metrics and told to the API server as Events, and
served as soon as there is room; a size the kernel cannot allocate fails the start, naming the map and the memory.
Real packets in a namespace lab, a real API server for the Events."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from apiobjects import Kube, service
from cluster.cluster import Cluster
from labkit.manifests import Port, endpoint_slice
from labkit.manifests import service as manifest_service
from labkit.netns import ipv6_of
from labkit.proxy import Pyproxy

pytestmark = pytest.mark.root

HTTP = Port("http", 80, 8080)
B1, B2 = "10.201.1.2", "10.201.2.2"


def cluster_of(n: int) -> list[str]:
    """Services svc-0..svc-(n-1) at 10.96.40.I, each with b1 and b2."""
    docs = []
    for i in range(n):
        docs += [manifest_service(f"svc-{i}", f"10.96.40.{i + 1}", [HTTP]),
                 endpoint_slice(f"svc-{i}", {B1: True, B2: True}, [HTTP])]
    return docs


def wait(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_full_services_map_leaves_out_only_what_does_not_fit(make_env: Callable) -> None:
    env = make_env(2)
    env.write("cluster.yaml", *cluster_of(3))
    # Room for three frontends: svc-0..2 now, and a fourth Service later does not fit.
    proxy = env.start(args=["--bpf-map-sizes=services=3"])
    for i in range(3):
        env.assert_reaches("tcp", f"10.96.40.{i + 1}", 80, {"b1:8080", "b2:8080"})
    holder = env.lab.popen(env.lab.client, sys.executable, "-m", "labkit.traffic", "hold", "10.96.40.1", "80",
                           "--count", "1", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        held = json.loads(holder.stdout.readline())[0]
        env.write("cluster.yaml", *cluster_of(5))
        wait(lambda: "Service default/svc-4 not programmed" in proxy.log_text(), "the unserved Services' log lines")
        log = proxy.log_text()
        assert re.search(r"Service default/svc-3 not programmed: BPF map pyproxy_svc_v2 would need \d+ entries but "
                         r"holds 3", log), proxy.log_tail()
        metrics = env.metrics()
        assert metrics['pyproxy_bpf_map_entries{map=pyproxy_svc_v2}'] == 3, metrics
        assert metrics['pyproxy_bpf_map_capacity{map=pyproxy_svc_v2}'] == 3, metrics
        assert metrics["pyproxy_bpf_services_unserved"] == 2, metrics
        # The Services already served never stopped; the held connection goes on.
        for i in range(3):
            env.assert_reaches("tcp", f"10.96.40.{i + 1}", 80, {"b1:8080", "b2:8080"})
        holder.stdin.write(f"keep {held}\n")
        holder.stdin.flush()
        assert json.loads(holder.stdout.readline()) == [held], "the held connection ended"
        # Logged once, not at every sync (the next syncs try it again, quietly).
        time.sleep(2.5)
        assert proxy.log_text().count("Service default/svc-3 not programmed") == 1, proxy.log_tail()
        # Room again: svc-1 and svc-2 go, svc-3 and svc-4 come.
        env.write("cluster.yaml", *(cluster_of(5)[:2] + cluster_of(5)[6:]))
        wait(lambda: "Service default/svc-4 programmed" in proxy.log_text(), "the left-out Services programmed")
        for i in (0, 3, 4):
            env.assert_reaches("tcp", f"10.96.40.{i + 1}", 80, {"b1:8080", "b2:8080"})
        assert env.metrics()["pyproxy_bpf_services_unserved"] == 0
    finally:
        holder.kill()
        holder.wait()


def test_a_full_ipv6_map_leaves_out_only_the_ipv6_service_that_does_not_fit(make_env: Callable) -> None:
    """Each family against its own map: with services6=2, two IPv6 Services fit and a third is left out naming
    pyproxy_svc6_v1, while three IPv4 Services (more than the IPv6 map holds) are all served."""
    env = make_env(2, ipv6=True)
    b1, b2 = ipv6_of(B1), ipv6_of(B2)
    docs = cluster_of(3)
    for i in range(3):
        docs += [manifest_service(f"svc6-{i}", f"fd00:10:96:40::{i + 1}", [HTTP],
                                  cluster_ips=[f"fd00:10:96:40::{i + 1}"]),
                 endpoint_slice(f"svc6-{i}", {b1: True, b2: True}, [HTTP])]
    env.write("cluster.yaml", *docs)
    proxy = env.start(args=["--bpf-map-sizes=services6=2"])
    wait(lambda: "Service default/svc6-2 not programmed" in proxy.log_text(), "the unserved IPv6 Service's log line")
    log = proxy.log_text()
    assert re.search(r"Service default/svc6-2 not programmed: BPF map pyproxy_svc6_v1 would need 3 entries but "
                     r"holds 2", log), proxy.log_tail()
    assert "not programmed" not in log.replace("Service default/svc6-2 not programmed", ""), proxy.log_tail()
    for i in range(3):
        env.assert_reaches("tcp", f"10.96.40.{i + 1}", 80, {"b1:8080", "b2:8080"})
    for i in range(2):
        result = env.probe("tcp", f"fd00:10:96:40::{i + 1}", 80, 20)
        assert result["failures"] == 0 and set(result["replies"]) == {"b1:8080", "b2:8080"}, result
    metrics = env.metrics()
    assert metrics["pyproxy_bpf_map_entries{map=pyproxy_svc6_v1}"] == 2, metrics
    assert metrics["pyproxy_bpf_map_capacity{map=pyproxy_svc6_v1}"] == 2, metrics
    assert metrics["pyproxy_bpf_map_entries{map=pyproxy_svc_v2}"] == 3, metrics
    assert metrics["pyproxy_bpf_services_unserved"] == 1, metrics


def test_a_left_out_service_gets_a_kubernetes_event(make_env: Callable, cluster: Cluster, kube: Kube,
                                                     namespace: str) -> None:
    env = make_env(2)
    # Room for what the cluster serves already (its `kubernetes` Service, other tests' leftovers) and one more.
    status, body = cluster.request("GET", "/api/v1/services")
    assert status == 200, body
    served = sum(len(s["spec"].get("ports", [])) for s in body["items"]
                 if s["spec"].get("clusterIP") not in (None, "", "None") and s["spec"].get("type") != "ExternalName")
    env.start_api(cluster, args=[f"--bpf-map-sizes=services={served + 1}"])
    for name, ip in (("first", "10.96.41.1"), ("second", "10.96.41.2")):
        kube.create(service(name, ip, namespace=namespace))
        kube.create(kube.endpoint_slice(f"{name}-1", name, [B1], namespace=namespace))

    def events() -> list[dict]:
        status, body = cluster.request("GET", f"/api/v1/namespaces/{namespace}/events")
        assert status == 200, body
        return [e for e in body["items"] if e["reason"] == "FailedToProgram"]

    wait(lambda: bool(events()), "a FailedToProgram Event")
    time.sleep(2.0)  # a second Event would come with the next syncs
    assert len(events()) == 1, events()
    (event,) = events()
    assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "Service", event
    assert event["involvedObject"]["name"] == "second", event
    assert f"BPF map pyproxy_svc_v2 would need {served + 2} entries but holds {served + 1}" in event["message"], event
    assert event["source"]["component"] == "pyproxy", event


def test_a_size_the_kernel_cannot_allocate_fails_the_start_naming_the_map(make_env: Callable) -> None:
    env = make_env(1)
    env.write("cluster.yaml", *cluster_of(1))
    proxy = Pyproxy(env.lab, env.source, log_path=env.log_path, extra_args=["--bpf-map-sizes=ct=4000000000"],
                    mode="bpf")
    env.proxy = proxy
    proxy.start()
    assert proxy.proc is not None
    assert proxy.proc.wait(timeout=60) == 1, proxy.log_tail()
    assert re.search(r"pyproxy_ct_v3: 4,000,000,000 entries, about \d+\.\d GiB", proxy.log_text()), proxy.log_tail()
