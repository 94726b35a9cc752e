"""A mode that cannot render IPv6 yet (ipvs) keeps serving IPv4
exactly as before a dual-stack Service arrived: the proxier hands it the desired state without the IPv6
frontends (model.state.FamilyFilter), says so in one log line per sync that left some out, and its render()
of that state is the IPv4-only Service's."""

from __future__ import annotations

import pytest

from pyproxy.dataplane.bpf.backend import BpfDataplane
from pyproxy.dataplane.fake import FakeDataplane
from pyproxy.dataplane.iptables.render import render as iptables_render
from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.model.desired import compute_desired_state
from pyproxy.model.node import NodeInputs
from pyproxy.model.objects import Endpoint, EndpointPort, EndpointSlice, Protocol, Service, ServicePort
from pyproxy.model.state import BOTH_FAMILIES, IPV4_ONLY, FamilyFilter
from pyproxy.proxier.metrics import ProxyMetrics
from pyproxy.proxier.modes import AUTO_ORDER
from pyproxy.proxier.proxier import Proxier
from pyproxy.proxier.server import ProxyHealth

TCP = Protocol.TCP
PORT = ServicePort("http", 80, TCP, 8080, 30080)
NODE = NodeInputs("node-a", ("10.0.0.5", "fd00:1::5"), "10.0.0.5")
DUAL = Service("default", "web", "NodePort", ("10.96.0.10", "fd00::10"), (PORT,))
V4_ONLY = Service("default", "web", "NodePort", ("10.96.0.10",), (PORT,))
V6_ONLY = Service("default", "v6", "ClusterIP", ("fd00::20",), (PORT,))
SLICES = {
    "default/web": (EndpointSlice("default", "web-4", "web", "IPv4", (Endpoint(("10.244.1.5",)),),
                                  (EndpointPort("http", 8080, TCP),)),
                    EndpointSlice("default", "web-6", "web", "IPv6", (Endpoint(("fd00:244::5",)),),
                                  (EndpointPort("http", 8080, TCP),))),
}


def slices_for(key: str) -> tuple[EndpointSlice, ...]:
    return SLICES.get(key, ())


class Ipv4Only(FakeDataplane):
    mode = "ipvs"
    ip_families = IPV4_ONLY


def proxier(dp: FakeDataplane) -> Proxier:
    p = Proxier(dp, min_sync_period=0, sync_period=3600, metrics=ProxyMetrics("fake"),
                health=ProxyHealth(sync_period=30), node_name="node-a")
    p.set_node_inputs(NODE)
    return p


def frontends(dp: FakeDataplane) -> dict[str, list[str]]:
    return {key: [str(st.frontend) for st in states] for key, states in dp.state.services.items()}


def test_an_ipv4_only_mode_gets_the_ipv4_frontends_and_node_addresses_and_one_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    dp = Ipv4Only()
    p = proxier(dp)
    p.set_service("default/web", DUAL)
    p.set_service("default/v6", V6_ONLY)
    p.mark_synced()
    with caplog.at_level("WARNING", logger="pyproxy.proxier.proxier"):
        p.sync()
    assert frontends(dp) == {"default/web": ["10.0.0.5:30080/TCP", "10.96.0.10:80/TCP"]}
    assert dp.state.node.nodeport_addresses == ("10.0.0.5",)
    assert all(b.ip == "10.244.1.5" for st in dp.state.services["default/web"] for b in st.backends)
    assert [r.getMessage() for r in caplog.records] == [
        "ipvs mode renders IPv4 only (yet): the other family's frontends of default/v6, default/web are not served "
        "(3 frontends of 2 Services in all)"]
    # The model keeps both families (the health servers and `pyproxy inspect` are told what was served).
    assert len(p.desired.services["default/web"]) == 4 and p.served is dp.state
    caplog.clear()
    # A partial sync of another Service says nothing again; the left-out frontends stay left out.
    p.set_service("default/other", Service("default", "other", "ClusterIP", ("10.96.0.30",), (PORT,)))
    p.sync()
    assert dp.applies[-1][1] == {"default/other"} and "default/v6" not in dp.state.services
    assert caplog.records == []
    # The dual-stack Service becomes IPv4-only: the dataplane sees the same frontends, and no line.
    p.set_service("default/web", V4_ONLY)
    p.sync()
    assert frontends(dp)["default/web"] == ["10.0.0.5:30080/TCP", "10.96.0.10:80/TCP"]
    assert caplog.records == []


def test_a_mode_rendering_both_families_gets_the_desired_state_itself() -> None:
    dp = FakeDataplane()
    p = proxier(dp)
    p.set_service("default/web", DUAL)
    p.mark_synced()
    p.sync()
    assert dp.state is p.desired
    assert frontends(dp)["default/web"] == ["10.0.0.5:30080/TCP", "10.96.0.10:80/TCP", "fd00:1::5:30080/TCP",
                                             "fd00::10:80/TCP"]


def test_an_ipv4_only_state_passes_through_unchanged() -> None:
    desired = compute_desired_state({"default/web": V4_ONLY}, slices_for, NodeInputs("node-a", ("10.0.0.5",)))
    f = FamilyFilter(IPV4_ONLY)
    assert f.update(desired, None) is desired
    assert f.summary("ipvs") is None


def test_the_ipv4_modes_render_a_dual_stack_service_as_its_ipv4_half() -> None:
    """render() stays pure and sees IPv4 only: the iptables plan of the filtered dual-stack state is the plan of
    the IPv4-only Service (its rules are not ip6tables' yet)."""
    dual = FamilyFilter(IPV4_ONLY).update(compute_desired_state({"default/web": DUAL}, slices_for, NODE), None)
    single = compute_desired_state({"default/web": V4_ONLY}, slices_for,
                                   NodeInputs("node-a", ("10.0.0.5",), "10.0.0.5"))
    masq = MasqueradeSettings()
    assert (iptables_render(dual, set(dual.services), {}, masq).text
            == iptables_render(single, set(single.services), {}, masq).text)


def test_each_mode_says_which_families_it_renders() -> None:
    from pyproxy.dataplane.iptables.backend import IptablesDataplane, IptablesSettings
    from pyproxy.dataplane.ipvs.backend import IpvsDataplane, IpvsSettings
    from pyproxy.dataplane.nftables.backend import NftablesDataplane, NftablesSettings
    from pyproxy.dataplane.userspace.backend import UserspaceDataplane, UserspaceSettings
    families = {cls.mode: getattr(cls, "ip_families", IPV4_ONLY) for cls in (BpfDataplane,)}
    # nftables, iptables, ipvs and userspace say it per instance: both, unless start() finds IPv6 unusable here.
    families["nftables"] = NftablesDataplane(NftablesSettings()).ip_families
    families["iptables"] = IptablesDataplane(IptablesSettings()).ip_families
    families["ipvs"] = IpvsDataplane(IpvsSettings()).ip_families
    families["userspace"] = UserspaceDataplane(UserspaceSettings()).ip_families
    assert set(families) == set(AUTO_ORDER)
    assert families == {"bpf": BOTH_FAMILIES, "ipvs": BOTH_FAMILIES, "nftables": BOTH_FAMILIES,
                        "iptables": BOTH_FAMILIES, "userspace": BOTH_FAMILIES}
