"""pyproxy end to end: the CLI started as a user starts it, in a lab's node namespace, with real traffic.

Each test has its own Lab and pin path (see conftest.make_env) and asserts what a user would notice: who answers
a ClusterIP, how fast an update takes effect, what the log says about bad input, checksums the receivers accept,
and what stays or goes on SIGTERM and `pyproxy cleanup`.
"""

from __future__ import annotations

import time

import pytest
from labkit import describe
from labkit.manifests import Port, service
from scenarios import (
    DNS_IP,
    WEB_IP,
    assert_core_traffic,
    dns,
    names,
    remove_b3,
    start_web_and_dns,
    web,
    write_core_manifests,
)

from pyproxy.dataplane.bpf import abi, bcc

pytestmark = pytest.mark.root

LOADERS = [
    pytest.param([], id="libbpf"),
    pytest.param(["--bpf-loader=bcc"], id="bcc",
                 marks=pytest.mark.skipif(bcc.missing() is not None, reason=f"--bpf-loader=bcc: {bcc.missing()}")),
]


@pytest.mark.parametrize("distro", [False, True], ids=["plain", "distro"])
def test_clusterip_reaches_ready_backends_only(make_env, distro: bool) -> None:
    env = make_env(3, distro=distro)
    write_core_manifests(env)
    env.start()
    assert_core_traffic(env)


def test_xdp_on_the_client_facing_device(make_env) -> None:
    env = make_env(3)
    write_core_manifests(env)
    proxy = env.start(xdp_devices=[env.lab.node_client_ifname])
    link = env.lab.exec(env.lab.node, "ip", "-d", "link", "show", "dev", env.lab.node_client_ifname).stdout
    assert "prog/xdp" in link, f"--xdp-devices did not attach XDP:\n{link}"
    assert_core_traffic(env)
    prog_ids = {i for ids in env.attached_programs().values() for i in ids}
    assert proxy.terminate(10.0) == 0
    proxy.cleanup()
    assert env.leftovers(prog_ids) == []


def test_removed_endpoint_stops_getting_new_connections(make_env, record_property) -> None:
    env = make_env(3)
    start_web_and_dns(env)
    elapsed = remove_b3(env)
    record_property("endpoint_removal_seconds", elapsed)
    print(f"removed endpoint stopped getting new flows after {elapsed}s")
    assert elapsed is not None, "b3 still gets new connections 3 s after it left the EndpointSlice"
    env.assert_reaches("tcp", WEB_IP, 80, {"b1:8080", "b2:8080"})
    env.assert_reaches("udp", DNS_IP, 53, {"b1:5353", "b2:5353"})
    env.assert_no_checksum_errors()


def test_backend_behind_a_device_created_after_start(make_env, record_property) -> None:
    env = make_env(2)
    env.write("web.yaml", *web({b.ip: True for b in env.lab.backends}))
    env.start()
    env.assert_reaches("tcp", WEB_IP, 80, {"b1:8080", "b2:8080"})

    b3 = env.lab.add_backend()  # a new node interface (to-b3), servers running behind it
    env.write("web.yaml", *web({b.ip: True for b in env.lab.backends}))
    elapsed = env.poll(lambda: "b3:8080" in env.probe("tcp", WEB_IP, 80, 15)["replies"], deadline=10.0)
    record_property("new_device_backend_seconds", elapsed)
    assert elapsed is not None, f"{b3.name} behind the new {b3.node_ifname} got no traffic within 10 s"
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    env.assert_no_checksum_errors()


BROKEN_YAML = "apiVersion: v1\nkind: Service\nmetadata:\n  name: [unclosed\n  spec: {\n"


def test_bad_manifests_are_named_in_the_log_and_good_ones_keep_working(make_env) -> None:
    env = make_env(3)
    all_ready = {b.ip: True for b in env.lab.backends}
    env.write("web.yaml", *web(all_ready))
    env.write("dns.yaml", *dns(all_ready))
    env.write_raw("broken.yaml", BROKEN_YAML)
    env.write("invalid.yaml",
              service("bad-cluster-ip", "10.96.0.300", [Port("http", 80, 8080)]),
              service("bad-port", "10.96.0.31", [Port("http", 70000, 8080)]),
              service("bad-protocol", "10.96.0.32", [Port("http", 80, 8080, "FOO")]))
    proxy = env.start()
    for needle in ("broken.yaml", "default/bad-cluster-ip", "default/bad-port", "default/bad-protocol"):
        assert proxy.wait_for_log(needle, 5.0), f"the log does not name {needle}"
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    env.assert_reaches("udp", DNS_IP, 53, names(env, 5353))

    # Breaking a file that worked keeps what it defined.
    before = proxy.log_text().count("web.yaml")
    env.write_raw("web.yaml", BROKEN_YAML)
    assert env.poll(lambda: proxy.log_text().count("web.yaml") > before, 5.0) is not None, \
        "the log does not mention the broken web.yaml"
    time.sleep(1.5)  # a sync period, in case breaking the file did remove the service
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    assert proxy.running
    assert env.lab.http_get(env.lab.node, proxy.healthz_url)["status"] == 200
    env.assert_no_checksum_errors()


@pytest.mark.parametrize("loader", LOADERS)
def test_sigterm_keeps_the_dataplane_and_cleanup_removes_it(make_env, record_property, loader: list[str]) -> None:
    env = make_env(3)
    all_ready = {b.ip: True for b in env.lab.backends}
    env.write("web.yaml", *web(all_ready))
    env.write("dns.yaml", *dns(all_ready))
    proxy = env.start(args=loader)
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    attached = env.attached_programs()
    prog_ids = {i for ids in attached.values() for i in ids}
    assert prog_ids, f"no BPF program attached to any node device: {attached}"
    assert len(env.cgroup_programs()) == len(abi.SOCK_HOOKS), "the socket hooks, IPv4 and IPv6"
    # `pyproxy inspect` shows the service, its backends and that it counted the traffic.
    inspect = proxy.inspect()
    web_line = next((line for line in inspect.splitlines() if "default/web" in line), "")
    assert all(f"{b.ip}:8080" in web_line for b in env.lab.backends), inspect
    assert any(tok.isdigit() and int(tok) > 0 for tok in web_line.split()), f"no counters: {web_line}"

    start = time.monotonic()
    status = proxy.terminate(10.0)
    record_property("sigterm_exit_seconds", round(time.monotonic() - start, 3))
    assert status == 0, f"exit status on SIGTERM: {status} (None: still running after 10 s)"

    # The dataplane outlives the process: existing and new flows keep working.
    env.assert_reaches("tcp", WEB_IP, 80, names(env, 8080))
    env.assert_reaches("udp", DNS_IP, 53, names(env, 5353))
    env.assert_no_checksum_errors()
    assert env.attached_programs() == attached

    proxy.cleanup()
    assert env.leftovers(prog_ids) == []
    after = env.probe("tcp", WEB_IP, 80, 3, timeout=0.5)
    assert not after["replies"], f"the ClusterIP still answers after cleanup: {describe(after)}"
