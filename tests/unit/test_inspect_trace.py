"""`inspect trace` decided from a view alone (pyproxy/model/inspection.py), case by case as lb.h decides, and the
nftables reader's view of a table listing and conntrack lines."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import socket
import struct
from pathlib import Path

import pytest

from pyproxy.cli import parser, settings_from
from pyproxy.dataplane.netfilter import parse_conntrack
from pyproxy.dataplane.nftables import inspect as nft_inspect
from pyproxy.dataplane.trace import flow_hash, mix32, trace
from pyproxy.model.inspection import Affinity, Endpoint, Flow, Frontend, View, filtered, report, trace_text

CLIENT = "10.200.0.2"
B1, B2, B3 = Endpoint("10.201.1.2", 8080), Endpoint("10.201.2.2", 8080), Endpoint("10.201.3.2", 8080)


def web(**kw: object) -> Frontend:
    fields: dict[str, object] = {"ip": "10.96.0.10", "port": 80, "proto": "TCP", "name": "default/web:http",
                                 "service": "default/web", "scheduler": "random", "endpoints": (B1, B2)}
    return Frontend(**{**fields, **kw})  # type: ignore[arg-type]


def flow(backend: str = "10.201.2.2:8080", port: int = 40000, **kw: object) -> Flow:
    fields: dict[str, object] = {"proto": "TCP", "client": CLIENT, "client_port": port, "frontend": "10.96.0.10",
                                 "frontend_port": 80, "backend": backend, "service": "default/web:http",
                                 "state": "established"}
    return Flow(**{**fields, **kw})  # type: ignore[arg-type]


def test_an_established_flow_follows_its_backend() -> None:
    v = View("bpf", [web()], [flow(), flow("10.201.1.2:8080", port=40001)])
    t = trace(v, f"{CLIENT}:40000", "10.96.0.10:80/tcp")
    assert (t.verdict, t.backend, len(t.flows)) == ("established", "10.201.2.2:8080", 1)
    assert t.new_flow is not None and t.new_flow.verdict == "dnat"
    assert "established: follows its established flow to 10.201.2.2:8080" in trace_text(t)


def test_without_a_source_port_the_sources_flows_are_listed_and_a_new_flow_shown() -> None:
    v = View("bpf", [web()], [flow(), flow("10.201.1.2:8080", port=40001), flow(client="10.200.0.9")])
    t = trace(v, CLIENT, "10.96.0.10:80")
    assert t.verdict == "dnat" and t.backend is None
    assert {f.client_port for f in t.flows} == {40000, 40001}
    assert t.new_flow is not None and t.new_flow.shares == {"10.201.1.2:8080": 0.5, "10.201.2.2:8080": 0.5}


def test_a_new_flow_gets_the_schedulers_choice() -> None:
    t = trace(View("bpf", [web()], [flow()]), f"{CLIENT}:40009", "10.96.0.10:80/tcp")
    assert t.verdict == "dnat" and not t.flows
    assert t.new_flow is not None and t.new_flow.candidates == (B1, B2)


def test_a_flow_whose_backend_left_or_that_ended_is_scheduled_anew() -> None:
    gone = trace(View("bpf", [web()], [flow("10.201.3.2:8080")]), f"{CLIENT}:40000", "10.96.0.10:80/tcp")
    assert gone.verdict == "dnat" and "no longer an endpoint" in gone.why
    ended = trace(View("nftables", [web()], [flow(state="time_wait", ended=True)]), f"{CLIENT}:40000",
                  "10.96.0.10:80/tcp")
    assert ended.verdict == "dnat" and "has ended" in ended.why
    other = trace(View("bpf", [web()], [flow(service="default/old:http")]), f"{CLIENT}:40000", "10.96.0.10:80")
    assert other.verdict == "dnat" and "belongs to default/old:http" in other.why


def test_an_affinity_pinned_client_gets_its_endpoint_while_the_entry_lasts() -> None:
    fe = web(affinity_sec=600, endpoints=(B1, B2, B3))
    pinned = Affinity("TCP", CLIENT, "10.96.0.10", 80, "10.201.3.2:8080", fe.name, 590.0)
    t = trace(View("bpf", [fe], affinities=[pinned]), CLIENT, "10.96.0.10:80/tcp")
    assert (t.verdict, t.backend, t.affinity) == ("dnat", "10.201.3.2:8080", pinned)
    expired = dataclasses.replace(pinned, remaining_sec=-1.0)
    t = trace(View("bpf", [fe], affinities=[expired]), CLIENT, "10.96.0.10:80/tcp")
    assert t.backend is None and t.affinity is None and "ClientIP affinity keeps" in t.why
    # Another client's entry pins nobody else.
    t = trace(View("bpf", [fe], affinities=[pinned]), "10.200.0.3", "10.96.0.10:80/tcp")
    assert t.backend is None


def test_an_address_no_frontend_has_is_left_alone() -> None:
    v = View("bpf", [web(), web(ip="10.96.0.11", node=True)])
    for dst in ("10.96.0.99:80/tcp", "10.96.0.10:81/tcp", "10.96.0.10:80/udp", "10.96.0.11:80/tcp"):
        t = trace(v, CLIENT, dst)
        assert (t.verdict, t.frontend) == ("not a Service", None), dst


def test_no_endpoint_refuses_or_drops_and_source_ranges_drop_first() -> None:
    assert trace(View("bpf", [web(endpoints=())]), CLIENT, "10.96.0.10:80").verdict == "refused"
    assert trace(View("bpf", [web(endpoints=(), empty="dropped")]), CLIENT, "10.96.0.10:80").verdict == "dropped"
    ranged = View("bpf", [web(endpoints=(), source_ranges=("198.51.100.0/24",))])
    t = trace(ranged, CLIENT, "10.96.0.10:80")
    assert t.verdict == "dropped" and "outside the source ranges 198.51.100.0/24" in t.why
    assert trace(ranged, "198.51.100.7", "10.96.0.10:80").verdict == "refused"


def test_node_ports_of_the_nftables_table_match_every_node_address() -> None:
    v = View("nftables", [web(ip="", port=30080)], nodeport_ips=["10.200.0.1"])
    assert trace(v, CLIENT, "10.200.0.1:30080/tcp").verdict == "dnat"
    assert trace(v, CLIENT, "10.200.0.9:30080/tcp").verdict == "not a Service"


def test_hash_schedulers_name_the_endpoint_as_the_datapath_computes_it() -> None:
    sh = trace(View("bpf", [web(scheduler="sh", endpoints=(B1, B2, B3))]), CLIENT, "10.96.0.10:80")
    assert sh.backend == str((B1, B2, B3)[mix32(int.from_bytes(bytes([10, 200, 0, 2]), "little")) % 3])
    table = ("10.201.1.2:8080", "10.201.2.2:8080", "10.201.1.2:8080", "10.201.2.2:8080", "10.201.1.2:8080")
    fe = web(scheduler="maglev", table=table)
    by_port = trace(View("bpf", [fe]), f"{CLIENT}:40000", "10.96.0.10:80")
    assert by_port.backend == table[flow_hash(CLIENT, "10.96.0.10", 40000, 80, "TCP") % 5]
    any_port = trace(View("bpf", [fe]), CLIENT, "10.96.0.10:80")
    assert any_port.backend is None and any_port.new_flow is not None
    assert any_port.new_flow.shares == {"10.201.1.2:8080": 0.6, "10.201.2.2:8080": 0.4}


def test_least_connection_schedulers_name_the_least_loaded() -> None:
    eps = (Endpoint("10.201.1.2", 8080, 1, 3), Endpoint("10.201.2.2", 8080, 4, 3), Endpoint("10.201.3.2", 8080, 1, 5))
    assert trace(View("bpf", [web(scheduler="lc", endpoints=eps)]), CLIENT, "10.96.0.10:80").backend is None
    assert trace(View("bpf", [web(scheduler="sed", endpoints=eps)]), CLIENT, "10.96.0.10:80").backend == \
        "10.201.2.2:8080"
    idle = (*eps, Endpoint("10.201.4.2", 8080, 1, 0))
    assert trace(View("bpf", [web(scheduler="nq", endpoints=idle)]), CLIENT, "10.96.0.10:80").backend == \
        "10.201.4.2:8080"


@pytest.mark.parametrize("src, dst", [("10.200.0.2:0", "10.96.0.10:80"), ("nowhere", "10.96.0.10:80"),
                                      ("10.200.0.2", "10.96.0.10"), ("10.200.0.2", "10.96.0.10:80/sctp")])
def test_bad_addresses_are_refused(src: str, dst: str) -> None:
    with pytest.raises(ValueError):
        trace(View("bpf", [web()]), src, dst)


@pytest.mark.parametrize("src, dst", [("fd00:10:200::2", "10.96.0.10:80"), ("10.200.0.2", "[fd00:10:96::1]:80")])
def test_a_source_and_destination_of_two_families_are_refused(src: str, dst: str) -> None:
    with pytest.raises(ValueError, match="two IP families"):
        trace(View("bpf", [web()]), src, dst)


@pytest.mark.parametrize("src, dst, why", [
    ("fd00:10:200::2", "fd00:10:96::1:80", "such as 10.96.0.10:80/tcp or \\[fd00:10:96::1\\]:80/tcp"),
    ("[fd00:10:200::2", "[fd00:10:96::1]:80", "expected \\[IPv6 address\\]"),
    ("[fd00:10:200::2]x", "[fd00:10:96::1]:80", "expected \\[IPv6 address\\]"),
    ("[fd00:10:200::2]:0", "[fd00:10:96::1]:80", "source port must be"),
    ("fd00:10:200::zz", "[fd00:10:96::1]:80", "not an IPv4 or IPv6 address"),
])
def test_bad_ipv6_addresses_are_refused_saying_why(src: str, dst: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        trace(View("bpf", [web()]), src, dst)


CLIENT6, VIP6 = "fd00:10:200::2", "fd00:10:96::1"
E1, E2, E3 = Endpoint("fd00:10:201:1::2", 8080), Endpoint("fd00:10:201:2::2", 8080), Endpoint("fd00:10:201:3::2", 8080)


def web6(**kw: object) -> Frontend:
    return web(**{"ip": VIP6, "name": "default/web6:http", "service": "default/web6", "endpoints": (E1, E2), **kw})


def flow6(backend: str = "[fd00:10:201:2::2]:8080", port: int = 40000, **kw: object) -> Flow:
    return flow(backend, port, **{"client": CLIENT6, "frontend": VIP6, "service": "default/web6:http", **kw})


def test_an_ipv6_flow_is_traced_with_its_addresses_in_brackets() -> None:
    v = View("bpf", [web(), web6()], [flow(), flow6(), flow6("[fd00:10:201:1::2]:8080", port=40001)])
    # The source bare or in brackets, any spelling of the addresses: the view's are compressed.
    for src in (f"[{CLIENT6}]:40000", "[fd00:10:200:0:0:0:0:2]:40000"):
        t = trace(v, src, "[fd00:10:96:0::1]:80/tcp")
        assert (t.verdict, t.backend, len(t.flows)) == ("established", "[fd00:10:201:2::2]:8080", 1), src
    assert t.destination == "[fd00:10:96::1]:80/tcp"
    text = trace_text(t)
    assert "established: follows its established flow to [fd00:10:201:2::2]:8080" in text
    assert "frontend: default/web6:http at [fd00:10:96::1]:80/TCP" in text
    assert "endpoints: [fd00:10:201:1::2]:8080, [fd00:10:201:2::2]:8080" in text
    assert f"flow: tcp [{CLIENT6}]:40000 -> [fd00:10:201:2::2]:8080 (established)" in text
    for src in (CLIENT6, f"[{CLIENT6}]"):
        listed = trace(v, src, f"[{VIP6}]:80")
        assert {f.client_port for f in listed.flows} == {40000, 40001} and listed.backend is None
        assert listed.new_flow is not None and listed.new_flow.shares == {"[fd00:10:201:1::2]:8080": 0.5,
                                                                          "[fd00:10:201:2::2]:8080": 0.5}
    # The IPv4 frontend on the same port is another frontend: its flows are not the IPv6 one's.
    assert trace(v, f"{CLIENT}:40000", "10.96.0.10:80/tcp").backend == "10.201.2.2:8080"
    gone = trace(View("bpf", [web6(endpoints=(E1,))], [flow6()]), f"[{CLIENT6}]:40000", f"[{VIP6}]:80")
    assert gone.verdict == "dnat" and "no longer an endpoint" in gone.why and gone.backend == "[fd00:10:201:1::2]:8080"


def test_ipv6_affinity_source_ranges_and_no_endpoint() -> None:
    fe = web6(affinity_sec=600, endpoints=(E1, E2, E3))
    pinned = Affinity("TCP", CLIENT6, VIP6, 80, "[fd00:10:201:3::2]:8080", fe.name, 590.0)
    t = trace(View("bpf", [fe], affinities=[pinned]), CLIENT6, f"[{VIP6}]:80/tcp")
    assert (t.verdict, t.backend, t.affinity) == ("dnat", "[fd00:10:201:3::2]:8080", pinned)
    assert trace(View("bpf", [fe], affinities=[pinned]), "fd00:10:200::3", f"[{VIP6}]:80").backend is None
    ranged = View("bpf", [web6(source_ranges=("2001:db8:ffff::/48", "198.51.100.0/24"))])
    out = trace(ranged, CLIENT6, f"[{VIP6}]:80")
    assert out.verdict == "dropped" and "outside the source ranges 2001:db8:ffff::/48, 198.51.100.0/24" in out.why
    assert trace(ranged, "2001:db8:ffff::7", f"[{VIP6}]:80").verdict == "dnat"
    assert trace(View("bpf", [web6(endpoints=())]), CLIENT6, f"[{VIP6}]:80").verdict == "refused"
    assert trace(View("bpf", [web6()]), CLIENT6, f"[{VIP6}]:81").verdict == "not a Service"


def _words(ip: str) -> list[int]:
    """struct pyproxy_in6's four __be32 words as a little-endian host loads them (this test's machines)."""
    return list(struct.unpack("<4I", ipaddress.IPv6Address(ip).packed))


def test_ipv6_hash_schedulers_fold_the_addresses_as_the_datapath_does() -> None:
    # parse6.h's pyproxy_in6_fold (the XOR of the four words) is what sh and dh hash for IPv6.
    fold = _words(CLIENT6)[0] ^ _words(CLIENT6)[1] ^ _words(CLIENT6)[2] ^ _words(CLIENT6)[3]
    sh = trace(View("bpf", [web6(scheduler="sh", endpoints=(E1, E2, E3))]), CLIENT6, f"[{VIP6}]:80")
    assert sh.backend == str((E1, E2, E3)[mix32(fold) % 3])
    vfold = _words(VIP6)[0] ^ _words(VIP6)[1] ^ _words(VIP6)[2] ^ _words(VIP6)[3]
    dh = trace(View("bpf", [web6(scheduler="dh", endpoints=(E1, E2, E3))]), CLIENT6, f"[{VIP6}]:80")
    assert dh.backend == str((E1, E2, E3)[mix32(vfold) % 3])
    # lb6.h's pyproxy_lb6_flow_hash: every word of the source, the destination folded, then ports and protocol.
    h = mix32(_words(CLIENT6)[0] ^ 0x9E3779B9)
    for w in _words(CLIENT6)[1:]:
        h = mix32(h ^ w)
    h = mix32(h ^ vfold)
    ports = struct.unpack("<I", struct.pack("<HH", socket.htons(80), socket.htons(40000)))[0]
    h = mix32(mix32(h ^ ports) ^ socket.IPPROTO_TCP)
    assert flow_hash(CLIENT6, VIP6, 40000, 80, "TCP") == h
    table = tuple(map(str, (E1, E2, E1, E2, E3)))
    by_port = trace(View("bpf", [web6(scheduler="maglev", table=table, endpoints=(E1, E2, E3))]),
                    f"[{CLIENT6}]:40000", f"[{VIP6}]:80")
    assert by_port.backend == table[h % 5]


def test_the_report_writes_ipv6_addresses_in_brackets_in_aligned_columns() -> None:
    v = View("bpf", [web(), web6(), web6(ip="", port=30094, node_family=6, name="default/web6:np")],
             [flow(), flow6()], nodeport_ips=["fd00:10:200::1"])
    text = report(v)
    lines = text.splitlines()
    header = lines[0]
    row6 = next(line for line in lines if line.startswith("default/web6:http"))
    assert "[fd00:10:96::1]:80/TCP" in row6 and row6.endswith("[fd00:10:201:1::2]:8080, [fd00:10:201:2::2]:8080")
    assert row6.index("random") == header.index("SCHED")
    assert "[*]:30094/TCP" in text
    flows_header = next(line for line in lines if line.startswith("FLOW"))
    row = next(line for line in lines if line.startswith(f"TCP [{CLIENT6}]:40000 -> [fd00:10:96::1]:80"))
    assert row.index("[fd00:10:201:2::2]:8080") == flows_header.index("BACKEND")
    assert trace(v, CLIENT6, "[fd00:10:200::1]:30094/tcp").frontend == v.frontends[2]
    assert trace(v, CLIENT6, "[fd00:10:200::9]:30094/tcp").verdict == "not a Service"


def test_filters_keep_a_services_or_a_frontends_frontends_and_flows() -> None:
    other = web(ip="10.96.0.20", name="default/db:sql", service="default/db", port=5432)
    v = View("bpf", [web(), other], [flow(), flow(frontend="10.96.0.20", frontend_port=5432, service=other.name)])
    by_service = filtered(v, service="default/web")
    assert by_service.frontends == [web()] and by_service.flows == [flow()]
    by_frontend = filtered(v, frontend="10.96.0.20:5432/tcp")
    assert by_frontend.frontends == [other] and len(by_frontend.flows) == 1
    assert filtered(v, frontend="10.96.0.20:5432/udp").frontends == []
    assert json.loads(json.dumps(dataclasses.asdict(by_service)))["frontends"][0]["name"] == "default/web:http"
    assert "default/db" not in report(by_service)


def test_the_trace_subcommand_keeps_flags_given_before_it() -> None:
    args = parser().parse_args(["inspect", "-o", "json", "trace", "10.200.0.2", "10.96.0.10:80/tcp",
                                "--bpf-pin-path=/x"])
    assert (args.view, args.output, str(args.bpf_pin_path), args.v) == ("trace", "json", "/x", None)
    nested = parser().parse_args(["inspect", "-v", "5", "trace", "10.200.0.2", "10.96.0.10:80/tcp"])
    assert settings_from(nested).logging.verbosity == 5, "a nested subcommand's default must not reset -v"
    assert parser().parse_args(["inspect", "trace", "a", "b", "-o", "json"]).output == "json"
    assert parser().parse_args(["inspect", "--service", "default/web"]).view is None


CONNTRACK = """\
tcp      6 431999 ESTABLISHED src=10.200.0.2 dst=10.96.20.1 sport=39676 dport=80 src=10.201.1.2 dst=10.200.0.2 \
sport=8080 dport=39676 [ASSURED] mark=0 use=1
tcp      6 119 TIME_WAIT src=10.200.0.2 dst=10.96.20.5 sport=59952 dport=80 src=10.201.3.2 dst=10.200.0.2 \
sport=8080 dport=59952 [ASSURED] mark=0 use=1
udp      17 27 src=10.200.0.2 dst=10.96.20.1 sport=5000 dport=53 [UNREPLIED] src=10.201.2.2 dst=10.200.0.2 \
sport=5353 dport=5000 mark=0 use=1
icmp     1 29 src=10.200.0.2 dst=10.200.0.1 type=8 code=0 id=1 src=10.200.0.1 dst=10.200.0.2 type=0 code=0 id=1 use=1
conntrack v1.4.7 (conntrack-tools): 4 flow entries have been shown.
"""


def test_conntrack_lines_are_read_with_their_reply_source() -> None:
    tcp, ended, udp = parse_conntrack(CONNTRACK)
    assert (tcp.proto, tcp.sport, tcp.reply_src, tcp.reply_sport, tcp.state) == ("TCP", 39676, "10.201.1.2", 8080,
                                                                                  "established")
    assert ended.state == "time_wait"
    assert (udp.proto, udp.reply_src, udp.state, udp.expires_sec) == ("UDP", "10.201.2.2", "unreplied", 27)


def _listing() -> dict[str, object]:
    """A trimmed `nft -j list table ip pyproxy` of the flow-case Services web, sticky, empty and lb-closed."""
    t = {"family": "ip", "table": "pyproxy"}

    def elem(ip: str, chain: str) -> list[object]:
        return [{"concat": [ip, "tcp", 80]}, {"goto": {"target": chain}}]

    sticky_ep = "KNRTV3AZ-default/sticky/tcp/http__10.201.3.2/8080"
    return {"nftables": [
        {"table": {"family": "ip", "name": "pyproxy"}},
        {"map": {**t, "name": "service-ips", "elem": [elem("10.96.20.1", "service-AAAAAAAA-default/web/tcp/http"),
                                                      elem("10.96.20.5", "service-BBBBBBBB-default/sticky/tcp/http"),
                                                      elem("203.0.113.11", "external-CCCCCCCC-default/lb/tcp/http")]}},
        {"map": {**t, "name": "no-endpoint-services", "elem": [
            [{"elem": {"val": {"concat": ["10.96.20.3", "tcp", 80]}, "comment": "default/empty:http"}},
             {"goto": {"target": "reject-chain"}}]]}},
        {"map": {**t, "name": "firewall-ips", "elem": [elem("203.0.113.11", "firewall-DDDDDDDD-default/lb/tcp/http")]}},
        *({"chain": {**t, "name": name}} for name in (
            "service-AAAAAAAA-default/web/tcp/http", "endpoint-EEEEEEEE-default/web/tcp/http__10.201.1.2/8080",
            "endpoint-FFFFFFFF-default/web/tcp/http__10.201.2.2/8080", "service-BBBBBBBB-default/sticky/tcp/http",
            f"endpoint-{sticky_ep}", "external-CCCCCCCC-default/lb/tcp/http", "firewall-DDDDDDDD-default/lb/tcp/http",
            "endpoint-GGGGGGGG-default/lb/tcp/http__10.201.1.2/8080")),
        {"set": {**t, "name": f"affinity-{sticky_ep}", "timeout": 600, "elem": [{"elem": {"val": CLIENT,
                                                                                           "expires": 599}}]}},
        {"rule": {**t, "chain": "firewall-DDDDDDDD-default/lb/tcp/http", "expr": [
            {"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                       "right": {"set": [{"prefix": {"addr": "198.51.100.0", "len": 24}}, "192.0.2.7"]}}},
            {"drop": None}]}},
    ]}


def test_the_nftables_view_of_a_table_and_its_flows() -> None:
    v = nft_inspect.view(_listing(), parse_conntrack(CONNTRACK))
    fes = {fe.ip: fe for fe in v.frontends}
    assert fes["10.96.20.1"].endpoints == (B1, B2) and fes["10.96.20.1"].service == "default/web"
    assert fes["10.96.20.5"].affinity_sec == 600 and fes["10.96.20.5"].endpoints == (B3,)
    assert fes["10.96.20.3"].endpoints == () and fes["10.96.20.3"].name == "default/empty:http"
    assert fes["203.0.113.11"].source_ranges == ("192.0.2.7/32", "198.51.100.0/24")
    # The UDP flow is to a port no frontend has.
    assert [(f.backend, f.ended) for f in v.flows] == [("10.201.1.2:8080", False), ("10.201.3.2:8080", True)]
    assert trace(v, f"{CLIENT}:39676", "10.96.20.1:80/tcp").backend == "10.201.1.2:8080"
    assert trace(v, CLIENT, "10.96.20.5:80/tcp").backend == "10.201.3.2:8080"
    assert trace(v, CLIENT, "10.96.20.3:80/tcp").verdict == "refused"
    assert trace(v, CLIENT, "203.0.113.11:80/tcp").verdict == "dropped"
    assert trace(v, "198.51.100.1", "203.0.113.11:80/tcp").backend == "10.201.1.2:8080"


CAPTURED = Path(__file__).parent / "captured"


@pytest.fixture(scope="module")
def nft_dual() -> View:
    """Both tables of a run in nftables mode (tests/unit/captured/README), joined as `read()` joins them."""
    doc = json.loads((CAPTURED / "nftables-dualstack.json").read_text())
    return nft_inspect.view(doc, parse_conntrack((CAPTURED / "nftables-conntrack6.txt").read_text()))


def test_the_nftables_view_reads_the_ip6_table_beside_the_ip_one(nft_dual: View) -> None:
    fes = {(fe.ip, fe.port, fe.proto): fe for fe in nft_dual.frontends}
    assert [str(e) for e in fes[(VIP6, 80, "TCP")].endpoints] == ["[fd00:10:201:1::2]:8080", "[fd00:10:201:2::2]:8080"]
    assert fes[(VIP6, 80, "TCP")].name == "default/web6/tcp/http"
    assert [str(e) for e in fes[("10.96.20.1", 80, "TCP")].endpoints] == ["10.201.1.2:8080", "10.201.2.2:8080"]
    assert fes[("2001:db8::12", 80, "TCP")].source_ranges == ("2001:db8:ffff::/48",)
    assert fes[("fd00:10:96::3", 80, "TCP")].endpoints == () and fes[("fd00:10:96::3", 80, "TCP")].empty == "refused"
    assert nft_dual.nodeport_ips == ["10.200.0.1", "10.201.1.1", "10.201.2.1", "10.201.3.1", "fd00:10:200::1",
                                     "fd00:10:201:1::1", "fd00:10:201:2::1", "fd00:10:201:3::1"]
    assert trace(nft_dual, CLIENT6, "[2001:db8::12]:80/tcp").verdict == "dropped"
    assert trace(nft_dual, CLIENT6, "[fd00:10:200::1]:30093/tcp").verdict == "refused"
    assert trace(nft_dual, CLIENT, "10.200.0.1:30093/tcp").verdict == "not a Service"  # np6-empty is IPv6 only


def test_the_nftables_dual_stack_service_and_ipv6_flows_and_affinity(nft_dual: View) -> None:
    # The same chain names in both tables (external-LKDYN4ID-default/dual-np/tcp/http): each family's own endpoints.
    assert trace(nft_dual, CLIENT6, "[fd00:10:200::1]:30094/tcp").backend == "[fd00:10:201:2::2]:8080"
    assert trace(nft_dual, CLIENT, "10.200.0.1:30094/tcp").backend == "10.201.1.2:8080"
    assert trace(nft_dual, CLIENT6, "[fd00:10:96::30]:80/tcp").backend == "[fd00:10:201:2::2]:8080"
    assert trace(nft_dual, CLIENT, "10.96.20.30:80/tcp").backend == "10.201.1.2:8080"
    held = trace(nft_dual, f"[{CLIENT6}]:56552", f"[{VIP6}]:80/tcp")
    assert (held.verdict, held.backend) == ("established", "[fd00:10:201:2::2]:8080")
    # The affinity set's name holds the endpoint with its colons as dots: read back as the endpoint.
    pinned = trace(nft_dual, CLIENT6, "[fd00:10:96::40]:80/tcp")
    assert (pinned.verdict, pinned.backend) == ("dnat", "[fd00:10:201:3::2]:8080")
    assert pinned.affinity is not None and pinned.affinity.remaining_sec == 599
    assert [f.address for f in filtered(nft_dual, service="default/dual").frontends] == [
        "10.96.20.30:80/TCP", "[fd00:10:96::30]:80/TCP"]
