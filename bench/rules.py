"""How far a netfilter dataplane has programmed its Services, read cheaply: pyproxy's nftables and iptables
modes and upstream kube-proxy's iptables mode, for the control-plane and latency parts.

Method. Listing 10,000 Services' rules takes about a second (iptables-save -t nat prints some 300,000 lines),
so it cannot be polled like a BPF map. Every proxy here exports upstream's metric
`kubeproxy_sync_proxy_rules_last_timestamp_seconds`, set when a sync has written its rules (after
iptables-restore or `nft -f` returned). The checker reads /metrics every 50 ms (from a thread inside the
node's network namespace: no process per read) and lists the kernel's rules only when that timestamp moved,
i.e. once per sync; the frontends counted in that listing are what the sync programmed, and the sync's end
is the timestamp itself, so the time "programmed" is exact to the sync, not to the poll.

What is counted as one frontend fully programmed (all expected ClusterIPs 10.100.x.y:80/TCP):
- iptables (both modes write upstream's chains): nat `-A KUBE-SERVICES -d VIP/32 ... -j KUBE-SVC-X` and
  `-A KUBE-SVC-X ... -j KUBE-SEP-Y` lines, one per ready endpoint, from `iptables-<backend>-save -t nat`.
- nftables (pyproxy's `ip pyproxy` table): the VIP's element of the `service-ips` verdict map and its
  endpoint chains (`endpoint-HASH-ns/name/tcp/__ip/port`, one per ready endpoint): `nft list map` plus
  `nft list chains` (names only, no rules); a transaction is atomic, so they exist only with their rules.
  That count holds while Services are only added (programming from empty). One Service after a change is
  read from its own chain instead, the endpoints its rules `goto`: a partial sync that removes an endpoint
  leaves the endpoint's chain flushed, and deletes it later (pyproxy/dataplane/nftables/backend.py).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from labkit import Lab
from labkit.netns import NetnsThread
from prometheus_client.parser import text_string_to_metric_families

from bench import core

LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
METRICS_POLL_S = 0.05


class NetnsHttp(NetnsThread):
    """HTTP GETs to 127.0.0.1 inside an `ip netns` namespace, from a `NetnsThread`."""

    def _get(self, port: int, path: str, timeout: float) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def get(self, port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
        """(status, body); status 0 when nothing answers."""
        try:
            return self._pool.submit(self._get, port, path, timeout).result(timeout + 1)
        except (OSError, http.client.HTTPException):
            return 0, ""


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {"name{k=v,...}": value}."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


Lister = Callable[[], dict[str, int]]
"""Lists the kernel's rules: {ClusterIP: ready endpoints programmed} for every frontend on port 80/TCP."""
OneLister = Callable[[str], "int | None"]
"""The ready endpoints programmed for one ClusterIP (None: no frontend)."""

_KUBE_SERVICES = re.compile(r"^-A KUBE-SERVICES -d (\S+)/32 .*--dport 80 -j (KUBE-SVC-\S+)$")
_KUBE_SVC = re.compile(r"^-A (KUBE-SVC-\S+) .*-j KUBE-SEP-")


def run_in(lab: Lab, argv: Iterable[str], timeout: float = 120.0) -> str:
    return lab.exec(lab.node, *argv, timeout=timeout).stdout


def iptables_counts(save_text: str) -> dict[str, int]:
    chains: dict[str, str] = {}
    endpoints: Counter[str] = Counter()
    for line in save_text.splitlines():
        if line.startswith("-A KUBE-SERVICES "):
            m = _KUBE_SERVICES.match(line)
            if m:
                chains[m.group(1)] = m.group(2)
        elif line.startswith("-A KUBE-SVC-"):
            m = _KUBE_SVC.match(line)
            if m:
                endpoints[m.group(1)] += 1
    return {vip: endpoints[chain] for vip, chain in chains.items()}


def iptables_lister(lab: Lab, backend: str) -> Lister:
    return lambda: iptables_counts(run_in(lab, [f"iptables-{backend}-save", "-t", "nat"]))


_MAP_ELEM = re.compile(r"(\d+\.\d+\.\d+\.\d+) \. tcp \. 80 : goto (service-[^\s,]+)")
_ENDPOINT_CHAIN = re.compile(r"chain (endpoint-[^\s{]+)")


def nftables_counts(map_text: str, chains_text: str) -> dict[str, int]:
    """From `nft list map ip pyproxy service-ips` and `nft list chains`."""
    per_service: Counter[str] = Counter()
    for name in _ENDPOINT_CHAIN.findall(chains_text):
        # endpoint-HASH-ns/name/tcp/port__ip/port -> the service chain's tail ns/name/tcp/port
        per_service[name.split("-", 2)[2].split("__")[0]] += 1
    out = {}
    for vip, chain in _MAP_ELEM.findall(map_text):
        out[vip] = per_service[chain.split("-", 2)[2]]
    return out


def nftables_lister(lab: Lab) -> Lister:
    def lister() -> dict[str, int]:
        cp = lab.exec(lab.node, "nft", "list", "map", "ip", "pyproxy", "service-ips", check=False, timeout=120)
        if cp.returncode != 0:
            return {}
        return nftables_counts(cp.stdout, run_in(lab, ["nft", "list", "chains"]))
    return lister


_GOTO_ENDPOINT = re.compile(r"goto (endpoint-[^\s,}]+)")


def nftables_one(lab: Lab) -> OneLister:
    """The endpoints one VIP's service chain sends packets to (None: the VIP is no frontend)."""
    def one(vip: str) -> int | None:
        cp = lab.exec(lab.node, "nft", "list", "map", "ip", "pyproxy", "service-ips", check=False, timeout=120)
        chain = dict(_MAP_ELEM.findall(cp.stdout)).get(vip) if cp.returncode == 0 else None
        if chain is None:
            return None
        return len(set(_GOTO_ENDPOINT.findall(run_in(lab, ["nft", "list", "chain", "ip", "pyproxy", chain]))))
    return one


_LISTENING = re.compile(r"^LISTEN\s+\d+\s+\d+\s+(\d+\.\d+\.\d+\.\d+):80\s", re.M)


def userspace_counts(ss_text: str) -> dict[str, int]:
    """From `ss -Hltn`: the addresses listened on at port 80. The userspace proxy opens a frontend's listener in
    the sync that gives it its endpoints (and only with endpoints), which a socket listing does not show: a
    listening frontend counts as having all of them."""
    return {ip: core.ENDPOINTS for ip in _LISTENING.findall(ss_text)}


def userspace_lister(lab: Lab) -> Lister:
    return lambda: userspace_counts(run_in(lab, ["ss", "-Hltn"]))


def lister_for(lab: Lab, mode: str, backend: str | None) -> Lister:
    return nftables_lister(lab) if mode == "nftables" else iptables_lister(lab, backend or "legacy")


class SyncProgress:
    """The `Progress` of a netfilter dataplane (see bench/controlplane.py): programmed frontends counted once
    per sync, the sync's end read from the proxy's metric."""

    def __init__(self, lab: Lab, vips: list[str], lister: Lister, metrics_port: int,
                 one: OneLister | None = None) -> None:
        self.vips = vips
        self.lister = lister
        self.one = one
        """Reads one frontend after a change, where the whole listing would not show it (nftables)."""
        self.metrics_port = metrics_port
        self.http = NetnsHttp(lab.node)
        self.synced_at: float | None = None
        """Wall-clock end of the last sync whose rules were counted."""
        self.counts: dict[str, int] = {}
        self.done = 0
        self._next_read = 0.0
        self._lock = threading.Lock()

    def metrics(self) -> dict[str, float]:
        status, body = self.http.get(self.metrics_port, "/metrics")
        return parse_metrics(body) if status == 200 else {}

    def last_sync(self) -> float | None:
        """The proxy's last sync end (wall clock), straight from its metric; None before its first."""
        value = self.metrics().get(LAST_SYNC)
        return value if value else None

    def _recount(self) -> None:
        self.counts = self.lister()
        want = 10
        self.done = sum(1 for v in self.vips if self.counts.get(v) == want)

    def poll(self) -> int:
        """Expected frontends with all 10 endpoints as of the last sync (relisted only when a sync ended)."""
        now = time.monotonic()
        if now < self._next_read:
            return self.done
        self._next_read = now + METRICS_POLL_S
        synced = self.last_sync()
        if synced is not None and synced != self.synced_at:
            self.synced_at = synced
            self._recount()
        return self.done

    def backends(self, index: int) -> int | None:
        if self.one is not None:
            return self.one(self.vips[index])
        self._recount()
        return self.counts.get(self.vips[index])

    def applied(self, index: int, want: int, since: float, timeout: float) -> float | None:
        """The wall-clock end of the first sync after `since` that left frontend `index` with `want`
        endpoints; None if none did within `timeout`."""
        end = time.monotonic() + timeout
        seen = since
        while time.monotonic() < end:
            synced = self.last_sync()
            if synced is not None and synced > seen:
                seen = synced
                if self.backends(index) == want:
                    return synced
            time.sleep(0.01)
        return None

    def programmed_at(self) -> float | None:
        return self.synced_at

    def close(self) -> None:
        self.http.close()


def conntrack_flush(lab: Lab) -> None:
    """Forget the node's connections (each run starts with an empty table, whatever the previous left)."""
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        lab.exec(lab.node, "conntrack", "-F", check=False, timeout=30)


def proc_cpu_s(pid: int, children: bool = True) -> float:
    """A process's CPU seconds (user + system), with `children` those of its children it has waited for
    (iptables-restore, nft); 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + ((int(fields[13]) + int(fields[14])) if children else 0)
    return ticks / os.sysconf("SC_CLK_TCK")
