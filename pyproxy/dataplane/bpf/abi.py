"""Python mirror of bpf/include/pyproxy/abi.h, struct by struct and name by name.

Each class names the C struct it mirrors; `__be` fields hold the value whose in-memory bytes are in
network order (use `be32`/`be16` to build them); padding is explicit, as in C, because hash keys are
compared bytewise. tests/priv/test_abi.py checks sizes and offsets against the compiled object's BTF.

Over 600 lines because abi.h is: one mirror, in abi.h's order, is what a reader compares line by line with the C
(and the ABI test checks as a whole); split, a struct and its flags would drift apart.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct

# Map names: abi.h PYPROXY_MAP_*.
MAP_SERVICES = "pyproxy_svc_v2"
MAP_SLOTS = "pyproxy_slot_v1"
MAP_BACKENDS = "pyproxy_be_v1"
MAP_CT = "pyproxy_ct_v3"
MAP_STATS = "pyproxy_stat_v1"
MAP_COUNTERS = "pyproxy_cnt_v5"
MAP_NAMES = "pyproxy_name_v1"
MAP_EPOCH = "pyproxy_epoch_v1"
MAP_HPIN = "pyproxy_hpin_v1"
"""jiffies of the socket hooks' last hairpin choice (maps.h): whether TC looks for one."""
MAP_FRAGS = "pyproxy_frag_v1"
MAP_PORTS = "pyproxy_port_v1"
MAP_SOCKS = "pyproxy_sock_v1"
MAP_SOCKFLOWS = "pyproxy_sflow_v1"
"""(socket, frontend) -> the backend of an unconnected UDP socket's flow to that frontend (sock.h)."""
MAP_SOCKANS = "pyproxy_sans_v1"
"""(socket, backend) -> the frontend an unconnected UDP socket sent to: its answers' source (sock.h)."""
MAP_SRCRANGES = "pyproxy_range_v1"
MAP_CURSORS = "pyproxy_rr_v1"
MAP_TABLES = "pyproxy_tbl_v3"
MAP_EPSTATS = "pyproxy_epstat_v1"
MAP_DEVADDRS = "pyproxy_dev_v1"
MAP_REFUSALS = "pyproxy_refuse_v1"
"""Per-CPU token bucket of refusals (reject.h), both families."""
"""Node device (ifindex) -> its primary IPv4 address, for SNAT on kernels without BPF_FIB_LOOKUP_SRC (snat.py)."""
MAP_AFFINITY = "pyproxy_aff_v1"
"""(service id, backend) -> present: the backends in the slots of a frontend with ClientIP affinity, the only ones a
client's affinity keeps (maps.h; render.py writes it)."""
# IPv6: the twins of the maps holding an address (abi.h; README, "IPv6 in bpf mode").
MAP_SERVICES6 = "pyproxy_svc6_v1"
MAP_SLOTS6 = "pyproxy_slot6_v1"
MAP_BACKENDS6 = "pyproxy_be6_v1"
MAP_CT6 = "pyproxy_ct6_v2"
MAP_FRAGS6 = "pyproxy_frag6_v1"
MAP_SRCRANGES6 = "pyproxy_range6_v1"
MAP_TABLES6 = "pyproxy_tbl6_v1"
MAP_SOCKS6 = "pyproxy_sock6_v1"
MAP_SOCKFLOWS6 = "pyproxy_sflow6_v1"
MAP_SOCKANS6 = "pyproxy_sans6_v1"
MAP_DEVADDRS6 = "pyproxy_dev6_v1"
MAP_EPSTATS6 = "pyproxy_epstat6_v1"
MAP_AFFINITY6 = "pyproxy_aff6_v1"
MAP_JUMP6 = "pyproxy_jmp6_v1"
"""TC program array: JUMP6_TC_INGRESS, JUMP6_TC_EGRESS -> the IPv6 programs the IPv4 ones tail-call (loader fills)."""
MAP_XJUMP6 = "pyproxy_xjmp6_v1"
"""XDP program array: JUMP6_XDP -> the IPv6 XDP program."""
JUMP6_TC_INGRESS, JUMP6_TC_EGRESS, JUMP6_XDP = 0, 1, 0  # PYPROXY_JUMP6_*
TABLE_NAME = "pyproxy_table"
"""The name of each frontend's table (PYPROXY_MAP_TABLES' inner arrays)."""
MAP_PREFIX = "pyproxy_"
"""Every map name (and so every pin) starts with it: how cleanup and a newer layout find ours."""
ALL_MAPS = (MAP_SERVICES, MAP_SLOTS, MAP_BACKENDS, MAP_CT, MAP_STATS, MAP_COUNTERS, MAP_NAMES, MAP_EPOCH, MAP_HPIN,
            MAP_FRAGS, MAP_PORTS, MAP_SOCKS, MAP_SRCRANGES, MAP_CURSORS, MAP_TABLES, MAP_EPSTATS, MAP_DEVADDRS,
            MAP_REFUSALS, MAP_SOCKFLOWS, MAP_SOCKFLOWS6, MAP_SOCKANS, MAP_SOCKANS6,
            MAP_SERVICES6, MAP_SLOTS6, MAP_BACKENDS6, MAP_CT6, MAP_FRAGS6, MAP_SRCRANGES6, MAP_TABLES6, MAP_SOCKS6,
            MAP_DEVADDRS6, MAP_EPSTATS6, MAP_JUMP6, MAP_XJUMP6, MAP_AFFINITY, MAP_AFFINITY6)
TABLE6_NAME = "pyproxy_table6"
"""The name of each IPv6 frontend's table (PYPROXY_MAP_TABLES6' inner arrays)."""
RESIZABLE = {
    "services": MAP_SERVICES, "slots": MAP_SLOTS, "backends": MAP_BACKENDS, "ct": MAP_CT, "stats": MAP_STATS,
    "names": MAP_NAMES, "frags": MAP_FRAGS, "socks": MAP_SOCKS, "sockflows": MAP_SOCKFLOWS,
    "sockanswers": MAP_SOCKANS,
    "srcranges": MAP_SRCRANGES, "cursors": MAP_CURSORS, "tables": MAP_TABLES, "epstats": MAP_EPSTATS,
    "affinity": MAP_AFFINITY,
    "services6": MAP_SERVICES6, "slots6": MAP_SLOTS6, "backends6": MAP_BACKENDS6, "ct6": MAP_CT6,
    "frags6": MAP_FRAGS6, "socks6": MAP_SOCKS6, "sockflows6": MAP_SOCKFLOWS6, "sockanswers6": MAP_SOCKANS6,
    "srcranges6": MAP_SRCRANGES6,
    "tables6": MAP_TABLES6, "epstats6": MAP_EPSTATS6, "affinity6": MAP_AFFINITY6,
}
"""The maps whose capacity a setting may change (--bpf-map-sizes), by the short name a setting uses; an IPv6 twin's
is its IPv4 map's with a 6, and render's capacity check counts each family against its own map. Service ids
index stats, cursors and tables too: they hold as many as services (the largest id must fit); names, stats and
cursors serve both families. epstats holds one entry per backend: unless given its own size it takes the backends
map's (loader.load; epstats6 the backends6 map's); affinity at most one per slot: the slots map's unless given its
own (affinity6 the slots6 map's)."""
NAME_LEN = 128  # PYPROXY_NAME_LEN
PORT_WORDS = 1024  # PYPROXY_PORT_WORDS
CONFIG_VAR = "pyproxy_config"
"""The .rodata variable (struct pyproxy_config: connection-tracking timeouts, SNAT ports) the loader sets before
load."""
KERNEL_FIB_SRC = 0x1
"""PYPROXY_KERNEL_FIB_SRC (struct pyproxy_config.kernel): bpf_fib_lookup names SNAT's source address (kernel.py)."""
DEFAULT_SNAT_PORTS = (61000, 65535)
"""The source ports SNAT gives out by default (maps.h's pyproxy_config): above Linux's default ephemeral range,
32768-60999, so no node socket picks one (pyproxy/dataplane/bpf/snat.py)."""

# Program names in bpf/pyproxy.bpf.c; the "pyproxy_" prefix is how cleanup recognises ours.
PROG_TC_INGRESS = "pyproxy_tc_ingress"
PROG_TC_EGRESS = "pyproxy_tc_egress"
PROG_XDP = "pyproxy_xdp_ingress"
# Their IPv6 twins, which the loader puts in MAP_JUMP6 / MAP_XJUMP6 (never attached themselves).
PROG_TC_INGRESS6 = "pyproxy_tc_ingress6"
PROG_TC_EGRESS6 = "pyproxy_tc_egress6"
PROG_XDP6 = "pyproxy_xdp_ingress6"
JUMPS6 = {MAP_JUMP6: {JUMP6_TC_INGRESS: PROG_TC_INGRESS6, JUMP6_TC_EGRESS: PROG_TC_EGRESS6},
          MAP_XJUMP6: {JUMP6_XDP: PROG_XDP6}}
"""Program array -> index -> the IPv6 program the loader puts there after each load."""
# The socket hooks (cgroup programs) by the attach type each goes to (uapi enum bpf_attach_type).
PROG_CONNECT4 = "pyproxy_connect4"
PROG_SENDMSG4 = "pyproxy_sendmsg4"
PROG_RECVMSG4 = "pyproxy_recvmsg4"
PROG_GETPEERNAME4 = "pyproxy_getpeer4"
PROG_CONNECT6 = "pyproxy_connect6"
PROG_SENDMSG6 = "pyproxy_sendmsg6"
PROG_RECVMSG6 = "pyproxy_recvmsg6"
PROG_GETPEERNAME6 = "pyproxy_getpeer6"
PROG_RELEASE = "pyproxy_release"
PROG_UDP_DESTROY = "pyproxy_udp_destroy"
"""bpf/sockdestroy.bpf.c's iter/udp program (an object of its own: bpf_sock_destroy is 6.5's)."""
DESTROY_MAPS = (MAP_SOCKS, MAP_SOCKS6, MAP_BACKENDS, MAP_BACKENDS6)
"""The maps it reads, which must be the datapath's own (sockdestroy.py checks they are)."""
"""cgroup/sock_release, both families (a cgroup sock program; the others are sock_addr ones)."""
SOCK_HOOKS = {PROG_CONNECT4: 10, PROG_SENDMSG4: 14, PROG_RECVMSG4: 19, PROG_GETPEERNAME4: 29,
              PROG_CONNECT6: 11, PROG_SENDMSG6: 15, PROG_RECVMSG6: 20, PROG_GETPEERNAME6: 30, PROG_RELEASE: 34}
PROG_PREFIX = "pyproxy_"

SVC_F_AFFINITY = 0x1  # PYPROXY_SVC_F_AFFINITY
SVC_F_DROP = 0x2  # PYPROXY_SVC_F_DROP
SVC_F_RANGES = 0x4  # PYPROXY_SVC_F_RANGES
SVC_F_MASQ = 0x8  # PYPROXY_SVC_F_MASQ
SVC_F_NODE_VIEW = 0x10  # PYPROXY_SVC_F_NODE_VIEW
SVC_F_MASQ_OUTSIDE = 0x20  # PYPROXY_SVC_F_MASQ_OUTSIDE
SVC_F_SOCK_PODS = 0x40  # PYPROXY_SVC_F_SOCK_PODS
SVC_F_NODE_DENIED = 0x80  # PYPROXY_SVC_F_NODE_DENIED
# struct pyproxy_svc_value.sched (PYPROXY_SCHED_*), by the name a Service or --bpf-scheduler gives.
SCHED = {"random": 0, "rr": 1, "wrr": 2, "lc": 3, "sed": 4, "nq": 5, "sh": 6, "dh": 7, "maglev": 8}
SCHED_NAME = {v: k for k, v in SCHED.items()}
COUNTING_SCHEDULERS = frozenset({"lc", "sed", "nq"})
"""The schedulers that read backends' active flows: their flows are counted (CT_F_COUNTED)."""
SVC_SCOPE_PACKETS = 0  # PYPROXY_SVC_SCOPE_PACKETS
SVC_SCOPE_NODE = 1  # PYPROXY_SVC_SCOPE_NODE
SVC_SCOPE_HOST = 2  # PYPROXY_SVC_SCOPE_HOST

CT_FORWARD = 0  # PYPROXY_CT_FORWARD
CT_REVERSE = 1  # PYPROXY_CT_REVERSE
CT_AFFINITY = 2  # PYPROXY_CT_AFFINITY
CT_HAIRPIN = 3  # PYPROXY_CT_HAIRPIN

# struct pyproxy_ct_value.state (PYPROXY_CT_ST_*)
CT_ST_ESTABLISHED = 0
CT_ST_NEW = 1
CT_ST_CLOSING = 2
CT_ST_CLOSED = 3
CT_ST_SYN_RECV = 4
CT_ST_TIME_WAIT = 5
CT_STATE_NAME = {CT_ST_ESTABLISHED: "established", CT_ST_NEW: "new", CT_ST_CLOSING: "closing",
                 CT_ST_CLOSED: "closed", CT_ST_SYN_RECV: "syn-recv", CT_ST_TIME_WAIT: "time-wait"}
CT_ST_OVER = frozenset({CT_ST_CLOSED, CT_ST_TIME_WAIT})
"""States of a TCP flow that has ended (ct.h pyproxy_ct_over)."""
CT_ST_REOPENS = CT_ST_OVER | {CT_ST_CLOSING}
"""States of a TCP flow on which a SYN opens a new connection (ct.h pyproxy_ct_reopens)."""
# struct pyproxy_ct_value.flags (PYPROXY_CT_F_*)
CT_F_FIN_FWD = 0x1
CT_F_FIN_REV = 0x2
CT_F_MASQ = 0x4  # a Service flow's FORWARD entry: the flow has an SNAT pair
CT_F_SNAT = 0x8  # an entry of an SNAT pair (abi.h)
CT_F_COUNTED = 0x10  # a Service flow counted in its backend's active flows (lc, sed, nq)
CT_F_SEQ_UNKNOWN = 0x20  # a flow carried over from the layout before seq_end: any RST closes it (abi.h)

# enum pyproxy_counter, in order.
COUNTERS = (
    "new_flow",
    "established",
    "revnat",
    "no_backend",
    "rebalanced",
    "slot_miss",
    "ct_full",
    "ct_expired",
    "ct_reopened",
    "ct_untracked",
    "icmp_nat",
    "frag_nat",
    "sock_lb",
    "sock_refused",
    "no_local",
    "source_denied",
    "snat",
    "snat_no_port",
    "snat_no_route",
    "revsnat",
    "snat_early_reuse",
    "refusal_limited",
    "ct_rst_ignored",
)

IPPROTO = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP}
PROTO_NAME = {v: k for k, v in IPPROTO.items()}


def be32(ip: str) -> int:
    """A dotted IPv4 address as the u32 whose memory bytes are in network order."""
    return int(struct.unpack("=I", socket.inet_aton(ip))[0])


def be16(port: int) -> int:
    """A port as the u16 whose memory bytes are in network order."""
    return int(struct.unpack("=H", struct.pack("!H", port))[0])


def in6(ip: str) -> In6:
    """An IPv6 address as struct pyproxy_in6 (its sixteen bytes in network order)."""
    return In6.from_buffer_copy(ipaddress.IPv6Address(ip).packed)


def ip6_of(a: In6) -> str:
    return str(ipaddress.IPv6Address(bytes(a)))


def ip_of(v: int) -> str:
    return socket.inet_ntoa(struct.pack("=I", v))


def port_of(v: int) -> int:
    return int(struct.unpack("!H", struct.pack("=H", v))[0])


class SvcKey(ctypes.Structure):
    """struct pyproxy_svc_key"""

    _fields_ = [
        ("vip", ctypes.c_uint32),  # network order
        ("port", ctypes.c_uint16),  # network order
        ("proto", ctypes.c_uint8),
        ("scope", ctypes.c_uint8),  # SVC_SCOPE_*
    ]


class SvcValue(ctypes.Structure):
    """struct pyproxy_svc_value"""

    _fields_ = [
        ("svc_id", ctypes.c_uint32),  # host order
        ("backend_count", ctypes.c_uint16),  # host order
        ("flags", ctypes.c_uint16),  # host order
        ("affinity_ticks", ctypes.c_uint32),  # host order; jiffies (clock.py)
        ("sched", ctypes.c_uint8),  # SCHED
        ("pad", ctypes.c_uint8),
        ("table_size", ctypes.c_uint16),  # host order; entries in MAP_TABLES (wrr, maglev)
    ]


class SlotKey(ctypes.Structure):
    """struct pyproxy_slot_key"""

    _fields_ = [
        ("svc_id", ctypes.c_uint32),  # host order
        ("slot", ctypes.c_uint32),  # host order
    ]


class Backend(ctypes.Structure):
    """struct pyproxy_backend"""

    _fields_ = [
        ("addr", ctypes.c_uint32),  # network order
        ("port", ctypes.c_uint16),  # network order
        ("pad", ctypes.c_uint16),
    ]


class Slot(ctypes.Structure):
    """struct pyproxy_slot"""

    _fields_ = [
        ("addr", ctypes.c_uint32),  # network order
        ("port", ctypes.c_uint16),  # network order
        ("weight", ctypes.c_uint16),  # host order; 0 reads as 1
    ]


class AffinityKey(ctypes.Structure):
    """struct pyproxy_affinity_key"""

    _fields_ = [("svc_id", ctypes.c_uint32), ("be", Backend)]  # host order; the backend


class BackendInfo(ctypes.Structure):
    """struct pyproxy_backend_info"""

    _fields_ = [
        ("flags", ctypes.c_uint32),  # host order, reserved
        ("active", ctypes.c_int32),  # host order; open counted flows (lc, sed, nq)
    ]


class Cursor(ctypes.Structure):
    """struct pyproxy_cursor"""

    _fields_ = [("next", ctypes.c_uint32), ("pad", ctypes.c_uint32)]  # host order


class CtKey(ctypes.Structure):
    """struct pyproxy_ct_key"""

    _fields_ = [
        ("saddr", ctypes.c_uint32),  # network order
        ("daddr", ctypes.c_uint32),  # network order
        ("sport", ctypes.c_uint16),  # network order
        ("dport", ctypes.c_uint16),  # network order
        ("proto", ctypes.c_uint8),
        ("dir", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]


class CtValue(ctypes.Structure):
    """struct pyproxy_ct_value"""

    _fields_ = [
        ("nat_addr", ctypes.c_uint32),  # network order
        ("nat_port", ctypes.c_uint16),  # network order
        ("state", ctypes.c_uint8),  # CT_ST_*
        ("flags", ctypes.c_uint8),  # CT_F_*
        ("svc_id", ctypes.c_uint32),  # host order
        # host order; a Service flow's FORWARD entry: the backends epoch the backend was last confirmed at; any
        # other entry: the low 32 bits of the tick its flow began (abi.h)
        ("epoch", ctypes.c_uint32),
        ("last_seen", ctypes.c_uint64),  # host order; jiffies (bpf_jiffies64, clock.py)
        # host order; TCP: the end of the furthest segment the entry's sender sent (ct.h, the RST window)
        ("seq_end", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class CtValueV2(ctypes.Structure):
    """struct pyproxy_ct_value of pyproxy_ct_v2, the layout before seq_end: what an upgrade carries over
    (CT_CARRY_OVER)."""

    _fields_ = CtValue._fields_[:-2]  # all but seq_end and pad


class CtTimeoutTicks(ctypes.Structure):
    """struct pyproxy_ct_timeouts, in ticks"""

    _fields_ = [
        ("tcp_new", ctypes.c_uint32),
        ("tcp_established", ctypes.c_uint32),
        ("tcp_closing", ctypes.c_uint32),
        ("tcp_closed", ctypes.c_uint32),
        ("udp_new", ctypes.c_uint32),
        ("udp_established", ctypes.c_uint32),
        ("shortest", ctypes.c_uint32),  # the smallest timeout here
        ("tcp_syn_recv", ctypes.c_uint32),
        ("tcp_time_wait", ctypes.c_uint32),
        ("udp_stream_after", ctypes.c_uint32),  # not a timeout: when a replied UDP flow becomes a stream
    ]


class SnatPorts(ctypes.Structure):
    """struct pyproxy_snat_ports: the source ports SNAT gives out, inclusive, host order"""

    _fields_ = [("min", ctypes.c_uint16), ("max", ctypes.c_uint16), ("pad", ctypes.c_uint32)]


class Cidr(ctypes.Structure):
    """struct pyproxy_cidr"""

    _fields_ = [("addr", ctypes.c_uint32), ("mask", ctypes.c_uint32)]  # network order

    @classmethod
    def of(cls, cidr: str | None) -> Cidr:
        """The prefix `cidr` ("10.244.0.0/16"); None: none (mask 0)."""
        if cidr is None:
            return cls(0, 0)
        net = ipaddress.IPv4Network(cidr, strict=False)
        return cls(be32(str(net.network_address)), be32(str(net.netmask)))


class In6(ctypes.Structure):
    """struct pyproxy_in6: an IPv6 address, four words in network order (`in6` builds one)"""

    _fields_ = [("w", ctypes.c_uint32 * 4)]


class Cidr6(ctypes.Structure):
    """struct pyproxy_cidr6"""

    _fields_ = [("addr", In6), ("mask", In6)]

    @classmethod
    def of(cls, cidr: str | None) -> Cidr6:
        """The IPv6 prefix `cidr` ("fd00:10:244::/56"); None: none (mask 0)."""
        if cidr is None:
            return cls()
        net = ipaddress.IPv6Network(cidr, strict=False)
        return cls(in6(str(net.network_address)), in6(str(net.netmask)))


class RefusalBucket(ctypes.Structure):
    """struct pyproxy_refusal_bucket"""

    _fields_ = [("credit_ns", ctypes.c_uint64), ("last_ns", ctypes.c_uint64)]  # host order


class RefusalRate(ctypes.Structure):
    """struct pyproxy_refusal_rate"""

    _fields_ = [("ns_per_refusal", ctypes.c_uint32), ("burst", ctypes.c_uint32)]


REFUSALS_PER_SECOND = 1000
"""Refusals (TCP resets, ICMP unreachables) each CPU may send per second, and REFUSAL_BURST at once: the kernel's own
limits for its ICMP errors (net.ipv4.icmp_msgs_per_sec, icmp_msgs_burst)."""
REFUSAL_BURST = 50


class Config(ctypes.Structure):
    """struct pyproxy_config (the .rodata variable CONFIG_VAR)"""

    _fields_ = [
        ("ct", CtTimeoutTicks),
        ("snat", SnatPorts),
        ("cluster", Cidr),
        ("endpoint_counters", ctypes.c_uint32),  # 1: count per backend in MAP_EPSTATS
        ("kernel", ctypes.c_uint32),  # KERNEL_*: what the running kernel offers (kernel.py)
        ("pad", ctypes.c_uint32),
        ("cluster6", Cidr6),  # the cluster CIDR's IPv6 half
        ("refusal", RefusalRate),
        ("sock_hostns_only", ctypes.c_uint32),  # 1: the socket hooks translate the node's own netns only
        ("host_netns", ctypes.c_uint64),  # the node's network namespace cookie
    ]


class FragKey(ctypes.Structure):
    """struct pyproxy_frag_key"""

    _fields_ = [
        ("saddr", ctypes.c_uint32),  # network order
        ("daddr", ctypes.c_uint32),  # network order
        ("id", ctypes.c_uint16),  # network order
        ("proto", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


class FragValue(ctypes.Structure):
    """struct pyproxy_frag_value"""

    _fields_ = [
        ("sport", ctypes.c_uint16),  # network order
        ("dport", ctypes.c_uint16),  # network order
        ("pad", ctypes.c_uint32),
    ]


class SockKey(ctypes.Structure):
    """struct pyproxy_sock_key"""

    _fields_ = [
        ("cookie", ctypes.c_uint64),  # host order
        ("addr", ctypes.c_uint32),  # network order
        ("port", ctypes.c_uint16),  # network order
        ("pad", ctypes.c_uint16),
    ]


class SockValue(ctypes.Structure):
    """struct pyproxy_sock_value"""

    _fields_ = [
        ("addr", ctypes.c_uint32),  # network order
        ("port", ctypes.c_uint16),  # network order
        ("flags", ctypes.c_uint8),  # SOCK_F_*
        ("pad", ctypes.c_uint8),
    ]


SOCK_F_COUNTED = 0x1  # PYPROXY_SOCK_F_COUNTED


class SrcRangeKey(ctypes.Structure):
    """struct pyproxy_srcrange_key"""

    _fields_ = [
        ("prefixlen", ctypes.c_uint32),  # host order; 32 + the range's prefix length
        ("svc_id", ctypes.c_uint32),  # network order
        ("addr", ctypes.c_uint32),  # network order
    ]


class SvcStats(ctypes.Structure):
    """struct pyproxy_svc_stats: the value of MAP_STATS (per frontend) and of MAP_EPSTATS (per backend)"""

    _fields_ = [
        ("packets", ctypes.c_uint64),  # host order
        ("bytes", ctypes.c_uint64),  # host order
    ]


class Svc6Key(ctypes.Structure):
    """struct pyproxy_svc6_key"""

    _fields_ = [
        ("vip", In6),
        ("port", ctypes.c_uint16),  # network order
        ("proto", ctypes.c_uint8),
        ("scope", ctypes.c_uint8),  # SVC_SCOPE_*
    ]


class Backend6(ctypes.Structure):
    """struct pyproxy_backend6"""

    _fields_ = [
        ("addr", In6),
        ("port", ctypes.c_uint16),  # network order
        ("pad", ctypes.c_uint16),
    ]


class SockflowValue(ctypes.Structure):
    """struct pyproxy_sockflow_value"""

    _fields_ = [
        ("be", Backend),
        ("svc_id", ctypes.c_uint32),
        ("epoch", ctypes.c_uint32),
        ("last_seen", ctypes.c_uint64),  # jiffies
    ]


class Sockflow6Value(ctypes.Structure):
    """struct pyproxy_sockflow6_value"""

    _fields_ = [
        ("be", Backend6),
        ("svc_id", ctypes.c_uint32),
        ("epoch", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("last_seen", ctypes.c_uint64),  # jiffies
    ]


class Slot6(ctypes.Structure):
    """struct pyproxy_slot6"""

    _fields_ = [
        ("addr", In6),
        ("port", ctypes.c_uint16),  # network order
        ("weight", ctypes.c_uint16),  # host order; 0 reads as 1
    ]


class Affinity6Key(ctypes.Structure):
    """struct pyproxy_affinity6_key"""

    _fields_ = [("svc_id", ctypes.c_uint32), ("be", Backend6)]  # host order; the backend


class Ct6Key(ctypes.Structure):
    """struct pyproxy_ct6_key"""

    _fields_ = [
        ("saddr", In6),
        ("daddr", In6),
        ("sport", ctypes.c_uint16),  # network order
        ("dport", ctypes.c_uint16),  # network order
        ("proto", ctypes.c_uint8),
        ("dir", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]


class Ct6Value(ctypes.Structure):
    """struct pyproxy_ct6_value"""

    _fields_ = [
        ("nat_addr", In6),
        ("nat_port", ctypes.c_uint16),  # network order
        ("state", ctypes.c_uint8),  # CT_ST_*
        ("flags", ctypes.c_uint8),  # CT_F_*
        ("svc_id", ctypes.c_uint32),  # host order
        ("epoch", ctypes.c_uint32),  # host order
        ("seq_end", ctypes.c_uint32),  # host order; as CtValue's (took the place of a zero pad)
        ("last_seen", ctypes.c_uint64),  # host order; jiffies
    ]


class Ct6ValueV1(ctypes.Structure):
    """struct pyproxy_ct6_value of pyproxy_ct6_v1: its seq_end was a zero pad (CT_CARRY_OVER)."""

    _fields_ = [*Ct6Value._fields_[:-2], ("pad", ctypes.c_uint32), Ct6Value._fields_[-1]]  # seq_end was a pad


class Frag6Key(ctypes.Structure):
    """struct pyproxy_frag6_key"""

    _fields_ = [
        ("saddr", In6),
        ("daddr", In6),
        ("id", ctypes.c_uint32),  # network order
        ("proto", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]


class Sock6Key(ctypes.Structure):
    """struct pyproxy_sock6_key"""

    _fields_ = [
        ("cookie", ctypes.c_uint64),  # host order
        ("addr", In6),
        ("port", ctypes.c_uint16),  # network order
        ("pad", ctypes.c_uint16),
        ("pad2", ctypes.c_uint32),
    ]


class Sock6Value(ctypes.Structure):
    """struct pyproxy_sock6_value"""

    _fields_ = [
        ("addr", In6),
        ("port", ctypes.c_uint16),  # network order
        ("flags", ctypes.c_uint8),  # SOCK_F_*
        ("pad", ctypes.c_uint8),
    ]


class SrcRange6Key(ctypes.Structure):
    """struct pyproxy_srcrange6_key"""

    _fields_ = [
        ("prefixlen", ctypes.c_uint32),  # host order; 32 + the range's prefix length
        ("svc_id", ctypes.c_uint32),  # network order
        ("addr", In6),
    ]


class SvcName(ctypes.Structure):
    """struct pyproxy_svc_name"""

    _fields_ = [("name", ctypes.c_char * NAME_LEN)]  # NUL-terminated


# For the ABI test: every mirrored struct by its C name.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "pyproxy_svc_key": SvcKey,
    "pyproxy_svc_value": SvcValue,
    "pyproxy_slot_key": SlotKey,
    "pyproxy_backend": Backend,
    "pyproxy_slot": Slot,
    "pyproxy_affinity_key": AffinityKey,
    "pyproxy_backend_info": BackendInfo,
    "pyproxy_cursor": Cursor,
    "pyproxy_ct_key": CtKey,
    "pyproxy_ct_value": CtValue,
    "pyproxy_ct_timeouts": CtTimeoutTicks,
    "pyproxy_snat_ports": SnatPorts,
    "pyproxy_refusal_bucket": RefusalBucket,
    "pyproxy_refusal_rate": RefusalRate,
    "pyproxy_cidr": Cidr,
    "pyproxy_config": Config,
    "pyproxy_frag_key": FragKey,
    "pyproxy_frag_value": FragValue,
    "pyproxy_sock_key": SockKey,
    "pyproxy_sock_value": SockValue,
    "pyproxy_sockflow_value": SockflowValue,
    "pyproxy_srcrange_key": SrcRangeKey,
    "pyproxy_svc_stats": SvcStats,
    "pyproxy_svc_name": SvcName,
    "pyproxy_in6": In6,
    "pyproxy_cidr6": Cidr6,
    "pyproxy_svc6_key": Svc6Key,
    "pyproxy_backend6": Backend6,
    "pyproxy_slot6": Slot6,
    "pyproxy_affinity6_key": Affinity6Key,
    "pyproxy_ct6_key": Ct6Key,
    "pyproxy_ct6_value": Ct6Value,
    "pyproxy_frag6_key": Frag6Key,
    "pyproxy_sock6_key": Sock6Key,
    "pyproxy_sock6_value": Sock6Value,
    "pyproxy_sockflow6_value": Sockflow6Value,
    "pyproxy_srcrange6_key": SrcRange6Key,
}


class CarryOver:
    """A CT map whose layout changed, and how its entries become the new map's (loader.carry_over): a restarted
    pyproxy copies a previous release's flows across rather than dropping every connection it tracked."""

    def __init__(self, old: str, new: str, key: type[ctypes.Structure], old_value: type[ctypes.Structure],
                 value: type[ctypes.Structure]) -> None:
        self.old, self.new, self.key, self.old_value, self.value = old, new, key, old_value, value

    def convert(self, old: bytes) -> bytes:
        """One entry's value in the new layout: the fields both layouts have, and the flow marked as knowing no
        sequence (CT_F_SEQ_UNKNOWN: any RST closes it, as the old programs let it)."""
        src = self.old_value.from_buffer_copy(old)
        dst = self.value()
        names = {f[0] for f in self.value._fields_} - {"pad"}
        for name, *_ in self.old_value._fields_:
            if name in names:
                setattr(dst, name, getattr(src, name))
        dst.flags |= CT_F_SEQ_UNKNOWN
        return bytes(dst)


CT_CARRY_OVER = (
    CarryOver("pyproxy_ct_v2", MAP_CT, CtKey, CtValueV2, CtValue),
    CarryOver("pyproxy_ct6_v1", MAP_CT6, Ct6Key, Ct6ValueV1, Ct6Value),
)
"""The layouts before the sequence field (abi.h: pyproxy_ct_v3, pyproxy_ct6_v2), carried over at start."""
