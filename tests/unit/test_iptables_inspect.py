"""The iptables mode's inspect reader (pyproxy/dataplane/iptables/inspect.py) on output captured from a lab run
(tests/unit/captured/README): frontends, endpoints and draw probabilities from iptables-save, affinity from an
xt_recent list, flows from conntrack -L, and traces over that view."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyproxy.dataplane import netfilter as nf
from pyproxy.dataplane.iptables import inspect as ii
from pyproxy.dataplane.trace import trace
from pyproxy.model.inspection import ANY_NODE_ADDRESS, filtered, trace_text

CAPTURED = Path(__file__).parent / "captured"
CLIENT = "10.200.0.2"
# /proc/net/xt_recent/KUBE-SEP-HYWCQ6N44D73YF4U (10.201.2.2:8080 of default/sticky:http) and /proc/timer_list's
# jiffies, read together with the files.
RECENT = ("src=10.200.0.2 ttl: 64 last_seen: 4297483623 oldest_pkt: 5 4297483622, 4297483623, 4297483623, "
          "4297483623, 4297483623\n")
JIFFIES = 4297483753
STICKY_SEP = "KUBE-SEP-HYWCQ6N44D73YF4U"


def captured(conntrack: str, recent: dict[str, str], jiffies: int, ipv6: bool = False) -> ii.inspection.View:
    """The view of the captured tables (with ip6tables-save.txt's too when `ipv6`, as `read()` joins them), flows
    from the conntrack file `conntrack`, and `recent` lists by name, on a HZ=250 kernel at `jiffies`."""
    saved = nf.parse_save((CAPTURED / "iptables-save.txt").read_text())
    saved6 = nf.parse_save((CAPTURED / "ip6tables-save.txt").read_text()) if ipv6 else None
    ct = nf.parse_conntrack((CAPTURED / conntrack).read_text())
    return ii.view(saved, ct, {name: ii.parse_recent(text) for name, text in recent.items()}, ii.Clock(jiffies, 250),
                   saved6)


@pytest.fixture(scope="module")
def view() -> ii.inspection.View:
    return captured("iptables-conntrack.txt", {STICKY_SEP: RECENT}, JIFFIES)


def frontend(view: ii.inspection.View, ip: str, port: int, proto: str = "TCP") -> ii.inspection.Frontend:
    [fe] = [f for f in view.frontends if (f.ip, f.port, f.proto) == (ip, port, proto)]
    return fe


def test_rules_parse_with_negations_flags_and_quoted_comments() -> None:
    r = ii.Rule.parse('-p tcp -m comment --comment "default/sticky:http" -m recent --rcheck --seconds 600 --reap '
                      '--name KUBE-SEP-X --mask 255.255.255.255 --rsource -j KUBE-SEP-X')
    assert (r.proto, r.comment, r.target, r.get("--seconds"), r.conditional) == (
        "TCP", "default/sticky:http", "KUBE-SEP-X", "600", True)
    assert "--rcheck" in r.options and r.get("--rcheck") == ""
    masq = ii.Rule.parse("-m mark ! --mark 0x4000/0x4000 -j RETURN")
    assert masq.negated == {"--mark"} and masq.conditional
    assert not ii.Rule.parse('-m comment --comment "default/web:http" -j KUBE-SEP-Y').conditional


def test_cluster_ips_with_their_endpoints_and_the_draws_probabilities(view: ii.inspection.View) -> None:
    web = frontend(view, "10.96.20.1", 80)
    assert (web.name, web.service, web.scheduler) == ("default/web:http", "default/web", "random")
    assert [str(e) for e in web.endpoints] == ["10.201.1.2:8080", "10.201.2.2:8080"]
    assert web.probabilities == (0.5, 1.0)
    sticky = frontend(view, "10.96.20.5", 80)
    assert sticky.affinity_sec == 600 and len(sticky.endpoints) == 3
    # iptables prints 1/3 as 0.33333333349: the shares stay a third each.
    t = trace(view, f"{CLIENT}:1", "10.96.20.1:80/tcp")
    assert t.new_flow is not None and t.new_flow.shares == {"10.201.1.2:8080": 0.5, "10.201.2.2:8080": 0.5}
    assert "probability (0.5, then 1)" in t.why


def test_a_three_way_draw_gives_each_a_third() -> None:
    saved = nf.parse_save((CAPTURED / "iptables-save.txt").read_text())
    fe = frontend(ii.view(saved), "10.96.20.21", 80)  # topo-unhinted: three endpoints, no affinity
    t = trace(ii.view(saved), CLIENT, "10.96.20.21:80/tcp")
    assert fe.probabilities[-1] == 1.0 and len(fe.probabilities) == 3
    assert t.new_flow is not None and set(t.new_flow.shares.values()) == {0.3333}


def test_node_ports_external_policies_and_firewalls(view: ii.inspection.View) -> None:
    assert view.nodeport_ips == ["10.200.0.1", "10.201.1.1", "10.201.2.1", "10.201.3.1"]
    np = frontend(view, ANY_NODE_ADDRESS, 30080)
    assert np.name == "default/np:http" and len(np.endpoints) == 2
    # externalTrafficPolicy Local: outside clients get this node's endpoint only (KUBE-SVL), or are dropped.
    assert [str(e) for e in frontend(view, ANY_NODE_ADDRESS, 30082).endpoints] == ["10.201.1.2:8080"]
    assert trace(view, CLIENT, "10.200.0.1:30083/tcp").verdict == "dropped"
    assert not [f for f in view.frontends if f.port == 30083 and f.ip]  # its filter DROPs are one frontend
    closed = frontend(view, "203.0.113.11", 80)
    assert closed.source_ranges == ("198.51.100.0/24",)
    assert trace(view, CLIENT, "203.0.113.11:80/tcp").verdict == "dropped"
    assert trace(view, CLIENT, "203.0.113.12:80/tcp").verdict == "dnat"  # lb-open lets 10.200.0.0/24 in


def test_frontends_without_endpoints_from_the_filter_table(view: ii.inspection.View) -> None:
    assert trace(view, CLIENT, "10.96.20.3:80/tcp").verdict == "refused"
    assert trace(view, CLIENT, "10.96.20.3:53/udp").verdict == "refused"
    assert trace(view, CLIENT, "10.200.0.1:30084/tcp").verdict == "refused"
    assert trace(view, CLIENT, "10.96.20.16:80/tcp").verdict == "dropped"  # internalTrafficPolicy Local
    assert trace(view, CLIENT, "10.96.99.1:80/tcp").verdict == "not a Service"


def test_an_established_flow_from_conntrack(view: ii.inspection.View) -> None:
    t = trace(view, f"{CLIENT}:45056", "10.96.20.1:80/tcp")
    assert (t.verdict, t.backend) == ("established", "10.201.1.2:8080")
    assert "follows its established flow to 10.201.1.2:8080" in trace_text(t)
    assert {f.service for f in filtered(view, service="default/web").flows} == {"default/web:http",
                                                                               "default/web:dns"}
    # The node's own health checks (127.0.0.1:10256) are no Service's flows.
    assert all(f.frontend != "127.0.0.1" for f in view.flows)


def test_client_ip_affinity_from_the_recent_list(view: ii.inspection.View) -> None:
    t = trace(view, CLIENT, "10.96.20.5:80/tcp")
    assert (t.verdict, t.backend) == ("dnat", "10.201.2.2:8080")
    assert t.affinity is not None and t.affinity.remaining_sec == pytest.approx(600 - 130 / 250)
    # Past its --seconds the entry no longer pins: the draw decides.
    late = ii.view(nf.parse_save((CAPTURED / "iptables-save.txt").read_text()), (),
                   {STICKY_SEP: ii.parse_recent(RECENT)}, ii.Clock(JIFFIES + 601 * 250, 250))
    assert trace(late, CLIENT, "10.96.20.5:80/tcp").backend is None


def test_hz_from_jiffies_and_the_monotonic_clock() -> None:
    # Captured on a HZ=250 kernel: /proc/timer_list's jiffies and /proc/uptime read together.
    assert ii.jiffies_hz(4297482848, 10362.43) == 250
    assert ii.jiffies_hz(2**32 - 300 * 1000 + 5000 * 1000, 5000.2) == 1000
    assert ii.jiffies_hz(2**32 - 300 * 300 + 300 * 8_640_000, 8_640_003.0) == 300  # a hundred days up
    assert ii.jiffies_hz(12345, 5000.0) is None
    assert ii.read_jiffies("now at 1 nsecs\njiffies: 4297480885\n") == 4297480885
    assert ii.parse_recent("") == []


def test_only_the_iptables_modes_chains_count_as_its_tables() -> None:
    saved = nf.parse_save((CAPTURED / "iptables-save.txt").read_text())
    assert ii.is_ours(saved)
    ipvs_like = nf.parse_save("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\nCOMMIT\n")
    assert not ii.is_ours(ipvs_like)


# ------------------------------------------------------------------------------------------------ IPv6

CLIENT6 = "fd00:10:200::2"
# The list of [fd00:10:201:3::2]:8080 of default/sticky6:http, the kernel's IPv6 address in full (%pI6), and the
# jiffies, read with ip6tables-save.txt.
RECENT6 = {"KUBE-SEP-XC4YLXGQWXENC27K": "src=fd00:0010:0200:0000:0000:0000:0000:0002 ttl: 64 last_seen: 4303489712 "
                                        "oldest_pkt: 5 4303489710, 4303489712, 4303489712, 4303489712, 4303489712\n"}
JIFFIES6 = 4303489875


@pytest.fixture(scope="module")
def dual() -> ii.inspection.View:
    return captured("ip6tables-conntrack.txt", RECENT6, JIFFIES6, ipv6=True)


def test_ipv6_frontends_from_ip6tables_with_their_endpoints(dual: ii.inspection.View) -> None:
    web6 = frontend(dual, "fd00:10:96::1", 80)
    assert (web6.name, web6.service) == ("default/web6:http", "default/web6")
    assert [str(e) for e in web6.endpoints] == ["[fd00:10:201:1::2]:8080", "[fd00:10:201:2::2]:8080"]
    assert web6.probabilities == (0.5, 1.0) and web6.address == "[fd00:10:96::1]:80/TCP"
    assert [str(e) for e in frontend(dual, "fd00:10:96::1", 53, "UDP").endpoints] == [
        "[fd00:10:201:1::2]:5353", "[fd00:10:201:2::2]:5353"]
    # IPv4's frontends are still there, from iptables-save.
    assert [str(e) for e in frontend(dual, "10.96.20.1", 80).endpoints] == ["10.201.1.2:8080", "10.201.2.2:8080"]
    assert dual.nodeport_ips == ["10.200.0.1", "10.201.1.1", "10.201.2.1", "10.201.3.1", "fd00:10:200::1",
                                 "fd00:10:201:1::1", "fd00:10:201:2::1", "fd00:10:201:3::1"]


def test_a_dual_stack_service_has_each_familys_endpoints_on_its_cluster_ips_and_node_ports(
        dual: ii.inspection.View) -> None:
    assert [str(e) for e in frontend(dual, "10.96.20.30", 80).endpoints] == ["10.201.1.2:8080"]
    assert [str(e) for e in frontend(dual, "fd00:10:96::30", 80).endpoints] == ["[fd00:10:201:2::2]:8080"]
    # The NodePort 30094 of both families: one KUBE-NODEPORTS frontend in each table, each on its family's
    # addresses, though the chains have the same names in both.
    node_ports = [f for f in dual.frontends if (f.ip, f.port) == (ANY_NODE_ADDRESS, 30094)]
    assert sorted((f.address, tuple(map(str, f.endpoints))) for f in node_ports) == [
        ("*:30094/TCP", ("10.201.1.2:8080",)), ("[*]:30094/TCP", ("[fd00:10:201:2::2]:8080",))]
    assert trace(dual, CLIENT6, "[fd00:10:200::1]:30094/tcp").backend == "[fd00:10:201:2::2]:8080"
    assert trace(dual, CLIENT, "10.200.0.1:30094/tcp").backend == "10.201.1.2:8080"
    only6 = filtered(dual, frontend="[fd00:10:200::1]:30094/tcp")
    assert [f.address for f in only6.frontends] == ["[*]:30094/TCP"]
    assert {f.frontend for f in filtered(dual, service="default/dual").flows} == {"fd00:10:96::30"}


def test_ipv6_node_ports_firewalls_and_frontends_without_endpoints(dual: ii.inspection.View) -> None:
    assert trace(dual, CLIENT6, "[fd00:10:200::1]:30090/tcp").verdict == "dnat"
    assert [str(e) for e in frontend(dual, ANY_NODE_ADDRESS, 30092).endpoints] == ["[fd00:10:201:1::2]:8080"]
    closed = frontend(dual, "2001:db8::12", 80)
    assert closed.source_ranges == ("2001:db8:ffff::/48",)
    assert trace(dual, CLIENT6, "[2001:db8::12]:80/tcp").verdict == "dropped"
    assert trace(dual, "2001:db8:ffff::7", "[2001:db8::12]:80/tcp").verdict == "dnat"
    assert trace(dual, CLIENT6, "[2001:db8::13]:80/tcp").verdict == "dnat"  # lb6-open lets fd00:10:200::/64 in
    assert trace(dual, CLIENT6, "[fd00:10:96::3]:80/tcp").verdict == "refused"
    assert trace(dual, CLIENT6, "[fd00:10:200::1]:30093/tcp").verdict == "refused"
    assert trace(dual, CLIENT6, "[fd00:10:96::99]:80/tcp").verdict == "not a Service"


def test_an_established_ipv6_flow_and_ipv6_client_ip_affinity(dual: ii.inspection.View) -> None:
    t = trace(dual, f"[{CLIENT6}]:45328", "[fd00:10:96::1]:80/tcp")
    assert (t.verdict, t.backend) == ("established", "[fd00:10:201:1::2]:8080")
    assert f"[{CLIENT6}]:45328 -> [fd00:10:96::1]:80/tcp: established: follows its established flow to " \
           "[fd00:10:201:1::2]:8080" in trace_text(t)
    pinned = trace(dual, CLIENT6, "[fd00:10:96::40]:80/tcp")
    assert (pinned.verdict, pinned.backend) == ("dnat", "[fd00:10:201:3::2]:8080")
    assert pinned.affinity is not None and pinned.affinity.client == CLIENT6
    assert pinned.affinity.remaining_sec == pytest.approx(600 - (JIFFIES6 - 4303489712) / 250)
    assert len(pinned.flows) == 5 and all(f.ended for f in pinned.flows)
