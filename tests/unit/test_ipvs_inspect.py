"""The ipvs mode's inspect reader (pyproxy/dataplane/ipvs/inspect.py) on the kernel's output captured in the IPVS
guest (Debian's 6.1; tests/guest_ipvs/test_ipvs_e2e.py::test_inspect_answers_as_the_traffic_went prints it): a
client holding a connection to 10.96.0.30:7070 (rr) after five to 10.96.0.60:80 (rr, persistent 600 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyproxy.dataplane.ipvs import inspect as ii
from pyproxy.dataplane.ipvs import kernel
from pyproxy.dataplane.ipvs.render import (
    LOAD_BALANCER_FW_SET,
    LOAD_BALANCER_SOURCE_CIDR_SET,
    NO_LOCAL_SET,
    Real,
    Virtual,
)
from pyproxy.dataplane.trace import trace
from pyproxy.model.inspection import View, filtered, trace_text
from pyproxy.model.state import Backend

CAPTURED = Path(__file__).parent / "captured"
CLIENT = "10.200.0.2"
HOLD, STICKY = "10.96.0.30", "10.96.0.60"


def virtuals(text: str) -> dict[tuple[str, int, str], Virtual]:
    """`ipvsadm -Ln` as the virtual servers kernel.read_virtuals() returns (netlink, which ipvsadm reads too)."""
    out: dict[tuple[str, int, str], Virtual] = {}
    key = None
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in ("TCP", "UDP"):
            ip, _, port = words[1].partition(":")
            key = (ip, int(port), words[0])
            timeout = int(words[words.index("persistent") + 1]) if "persistent" in words else 0
            out[key] = Virtual(words[2], timeout, {})
        elif words[:1] == ["->"] and words[1] != "RemoteAddress:Port" and key is not None:
            ip, _, port = words[1].partition(":")
            reals = dict(out[key].reals)
            reals[Backend(ip, int(port))] = Real(int(words[3]), int(words[4]), int(words[5]))
            out[key] = Virtual(out[key].scheduler, out[key].timeout, reals)
    return out


@pytest.fixture(scope="module")
def view() -> View:
    return ii.view(virtuals((CAPTURED / "ipvsadm-Ln.txt").read_text()), (),
                   kernel.parse_sets((CAPTURED / "ipvs-ipset-save.txt").read_text()),
                   ii.parse_conns((CAPTURED / "ipvs-conn.txt").read_text()))


def test_the_connection_table_parses_connections_and_templates() -> None:
    conns = ii.parse_conns((CAPTURED / "ipvs-conn.txt").read_text())
    assert len(conns) == 9
    held = next(c for c in conns if c.vport == 7070)
    assert (held.proto, held.client, held.client_port, held.vip, held.dest, held.dport, held.state,
            held.expires_sec) == ("TCP", CLIENT, 51180, HOLD, "10.201.3.2", 7070, "established", 899)
    [template] = [c for c in conns if c.template]
    assert (template.vip, template.vport, template.dest, template.expires_sec) == (STICKY, 80, "10.201.3.2", 597)



def test_ipv6_connections_and_virtual_servers_are_listed() -> None:
    # An IPv6 line as Debian's 6.1 prints it (captured in the guest), and a newer kernel's bracketed destination.
    conns = ii.parse_conns(
        "Pro FromIP   FPrt ToIP     TPrt DestIP   DPrt State       Expires PEName PEData\n"
        "TCP fd00:0010:0200:0000:0000:0000:0000:0002 B04E fd00:0010:0096:0000:0000:0000:0000:000a 0050 "
        "fd00:0010:0244:0000:0000:0000:0000:0005 1F90 ESTABLISHED     899\n"
        "TCP fd00:0010:0200:0000:0000:0000:0000:0002 0000 fd00:0010:0096:0000:0000:0000:0000:000a 0050 "
        "[fd00:0010:0244:0000:0000:0000:0000:0005] 1F90 NONE 597\n")
    assert [(c.client, c.client_port, c.vip, c.vport, c.dest, c.dport, c.template) for c in conns] == [
        ("fd00:10:200::2", 45134, "fd00:10:96::a", 80, "fd00:10:244::5", 8080, False),
        ("fd00:10:200::2", 0, "fd00:10:96::a", 80, "fd00:10:244::5", 8080, True)]
    key6, key4 = ("fd00:10:96::a", 80, "TCP"), ("10.96.0.10", 80, "TCP")
    be6 = Backend("fd00:10:244::5", 8080)
    sets = {"KUBE-6-LOAD-BALANCER": frozenset({"fd00:10:96::a,tcp:80"}),
            "KUBE-6-LOAD-BALANCER-FW": frozenset({"fd00:10:96::a,tcp:80"}),
            "KUBE-6-LOAD-BALANCER-SOURCE-CID": frozenset({"fd00:10:96::a,tcp:80,fd00:10:200::2",
                                                          "fd00:10:96::a,tcp:80,fd00:10:300::/64"})}
    v = ii.view({key6: Virtual("rr", 600, {be6: Real(1, 1)}), key4: Virtual("rr")}, ("10.96.0.10",), sets, conns)
    assert [(f.name, f.ip) for f in v.frontends] == [("10.96.0.10:80/TCP", "10.96.0.10"),
                                                      ("[fd00:10:96::a]:80/TCP", "fd00:10:96::a")]
    fe = v.frontends[1]
    assert fe.source_ranges == ("fd00:10:200::2/128", "fd00:10:300::/64")
    assert [(e.ip, e.port, e.active) for e in fe.endpoints] == [("fd00:10:244::5", 8080, 1)]
    assert [(f.client, f.backend, f.service) for f in v.flows] == [
        ("fd00:10:200::2", "fd00:10:244::5:8080", fe.name)]
    assert [a.backend for a in v.affinities] == ["fd00:10:244::5:8080"]
    # --frontend takes an IPv6 address in brackets.
    narrowed = filtered(v, frontend="[fd00:10:96::a]:80/tcp")
    assert [f.name for f in narrowed.frontends] == [fe.name] and len(narrowed.flows) == 1
    assert filtered(v, frontend="[fd00:10:96::a]:81").frontends == []


def test_frontends_are_the_virtual_servers_named_by_address(view: View) -> None:
    assert [(f.name, f.scheduler, f.affinity_sec) for f in view.frontends] == [
        (f"{HOLD}:7070/TCP", "rr", 0), (f"{STICKY}:80/TCP", "rr", 600)]
    hold = view.frontends[0]
    assert [(str(e), e.weight, e.active) for e in hold.endpoints] == [
        ("10.201.1.2:7070", 1, 0), ("10.201.2.2:7070", 1, 0), ("10.201.3.2:7070", 1, 1)]


def test_an_established_flow_from_ipvss_connection_table(view: View) -> None:
    t = trace(view, f"{CLIENT}:51180", f"{HOLD}:7070/tcp")
    assert (t.verdict, t.backend) == ("established", "10.201.3.2:7070")
    assert "follows its established flow to 10.201.3.2:7070" in trace_text(t)


def test_a_new_flow_names_the_candidates_and_the_schedulers_rule(view: View) -> None:
    t = trace(view, f"{CLIENT}:1", f"{HOLD}:7070/tcp")
    assert t.verdict == "dnat" and t.backend is None and t.new_flow is not None
    assert t.why == "rr: IPVS's round robin, the next real server in turn"
    assert set(t.new_flow.shares) == {"10.201.1.2:7070", "10.201.2.2:7070", "10.201.3.2:7070"}


def test_a_persistence_template_pins_the_client(view: View) -> None:
    t = trace(view, CLIENT, f"{STICKY}:80/tcp")
    assert (t.verdict, t.backend) == ("dnat", "10.201.3.2:8080")
    assert t.affinity is not None and t.affinity.remaining_sec == 597
    assert all(f.ended for f in t.flows) and len(t.flows) == 7  # the five probes and two earlier, in TIME_WAIT


def test_policy_from_the_ipsets_weights_and_other_schedulers() -> None:
    key, lb = ("203.0.113.5", 80, "TCP"), ("203.0.113.6", 80, "TCP")
    a, b = Backend("10.201.1.2", 8080), Backend("10.201.2.2", 8080)
    sets = {"KUBE-LOAD-BALANCER": frozenset({"203.0.113.5,tcp:80", "203.0.113.6,tcp:80"}),
            LOAD_BALANCER_FW_SET: frozenset({"203.0.113.5,tcp:80"}),
            LOAD_BALANCER_SOURCE_CIDR_SET: frozenset({"203.0.113.5,tcp:80,198.51.100.0/24",
                                                      "203.0.113.5,tcp:80,10.200.0.9"}),
            NO_LOCAL_SET: frozenset({"203.0.113.6,tcp:80"})}
    v = ii.view({key: Virtual("wrr", 0, {a: Real(3), b: Real(1)}), lb: Virtual("mh", 0, {a: Real(1)})},
                (), sets)
    fe = v.frontends[0]
    assert fe.source_ranges == ("10.200.0.9/32", "198.51.100.0/24")
    assert trace(v, CLIENT, "203.0.113.5:80/tcp").verdict == "dropped"
    t = trace(v, "10.200.0.9", "203.0.113.5:80/tcp")
    assert t.new_flow is not None and t.new_flow.shares == {"10.201.1.2:8080": 0.75, "10.201.2.2:8080": 0.25}
    assert trace(v, CLIENT, "203.0.113.6:80/tcp").verdict == "dropped"  # Local, no endpoint here
    drained = ii.view({key: Virtual("sh", 0, {a: Real(0)})}, (), sets)
    assert trace(drained, "10.200.0.9", "203.0.113.5:80/tcp").verdict == "refused"
    # Another's virtual server (not on kube-ipvs0, in no set of ours) is not shown.
    assert ii.view({("10.0.0.1", 80, "TCP"): Virtual("rr")}, (), {}).frontends == []
