/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* The maps, one comment each on what it is for. Layouts live in abi.h. */
#ifndef PYPROXY_MAPS_H
#define PYPROXY_MAPS_H

#include <bpf/bpf_helpers.h>
#include "pyproxy/abi.h"

#ifdef PYPROXY_BCC
/* BCC compiles these sources too (--bpf-loader=bcc): the same maps in its form. */
#include "pyproxy/bcc.h"
#else

/* Frontends: (ClusterIP, port, protocol) -> service id and ready-backend count. The first lookup of
 * every packet; a miss means "not ours" and the packet passes untouched. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_SERVICES);
	__type(key, struct pyproxy_svc_key);
	__type(value, struct pyproxy_svc_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SERVICES SEC(".maps");

/* Backend slots: (service id, n) -> backend and its weight, so choosing among n ready backends is one random
 * number (or hash, or turn) and one lookup, whatever the number of services. Not preallocated: sized by the sum of
 * backends. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_SLOTS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_slot_key);
	__type(value, struct pyproxy_slot);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SLOTS SEC(".maps");

/* Every endpoint of every slice, ready or not. An established flow keeps its backend while the
 * backend is here; once it is gone (pod deleted) the flow is re-balanced, as upstream flushes
 * conntrack entries of removed endpoints. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_BACKENDS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_backend);
	__type(value, struct pyproxy_backend_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_BACKENDS SEC(".maps");

/* ClientIP affinity's usable backends: (service id, backend) -> present (value unused), for every backend in the
 * slots of a frontend flagged PYPROXY_SVC_F_AFFINITY, and for no other frontend. A client's new flow goes to the
 * backend its AFFINITY entry names only while the backend is here, one of the endpoints new flows may use (the
 * ready ones, or the serving and terminating ones while none is ready), as upstream honours affinity; one that is
 * not ready, terminating beside ready ones, or an endpoint of another Service only, is not, and the flow chooses
 * anew. One lookup whatever the frontend's size: it takes the place of the backends map's (every endpoint of
 * every slice). The control plane writes a backend here before any slot holds it and deletes it after none does
 * (render.py). Not preallocated: sized as the slots map. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_AFFINITY);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_affinity_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_AFFINITY SEC(".maps");

/* Connection tracking: a FORWARD entry keeps a flow on its backend, a REVERSE entry gives replies
 * their frontend address back, an AFFINITY entry remembers a client's backend for ClientIP affinity; an
 * SNATed flow has a second, mirrored FORWARD/REVERSE pair holding its node address and port (abi.h, snat.h).
 * FORWARD and REVERSE entries carry the flow's state and expire by its idle timeout (ct.h); the control
 * plane's collector deletes expired entries (pyproxy/dataplane/bpf/gc.py). LRU, so a full table evicts the
 * oldest flows instead of refusing new ones. Pinned: a restarted pyproxy keeps every connection. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_FLOWS);
	__type(key, struct pyproxy_ct_key);
	__type(value, struct pyproxy_ct_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_CT SEC(".maps");

/* The backends epoch, one __u32 at index 0: the control plane bumps it after every change that removed
 * backends from PYPROXY_MAP_BACKENDS (and at start). An established flow re-checks that its backend is
 * still an endpoint only when its entry's epoch is not the current one, so the common packet skips that
 * hash lookup; the bump comes after the deletions, so no flow can confirm a removed backend again. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_EPOCH SEC(".maps");

/* When a socket hook last left a pod's connect() to itself to TC (lb.h, pyproxy_hairpin_claim): jiffies, one __u64
 * at index 0. A new flow from a pod looks for such a choice in the CT map only while one is that fresh, so the
 * common new flow pays an array read, not a hash miss (bench: about 220 ns of a new ClusterIP flow's 1,000). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_HPIN SEC(".maps");

/* Datagrams in fragments whose first fragment was translated: later fragments carry no ports, so they find
 * their flow through the ports recorded here (keyed as they arrive, before translation). LRU: a datagram
 * whose last fragment never came needs no clean-up. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_FRAGS);
	__type(key, struct pyproxy_frag_key);
	__type(value, struct pyproxy_frag_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_FRAGS SEC(".maps");

/* Every port some endpoint listens on, a bit per port (index port / 64, bit port % 64). A packet that is no
 * Service's but may start a new flow to an endpoint (a TCP SYN, a UDP datagram) looks for an old Service
 * flow's reverse entry on its tuple only when its destination port is here: an array read, inlined by the
 * verifier, instead of a hash lookup for all such traffic (overlay tunnels, replies, DNS to other hosts). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PYPROXY_PORT_WORDS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_PORTS SEC(".maps");

/* Socket load balancing (sock.h): (socket, backend) -> the frontend the socket asked for, so the socket's
 * peer name and its received datagrams' sources read as the frontend. Only connected sockets' entries: a socket's
 * close deletes the entry of the address it is connected to (cgroup/sock_release), so the LRU evicts one only
 * when more translated sockets than it holds are open at once. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_SOCKS);
	__type(key, struct pyproxy_sock_key);
	__type(value, struct pyproxy_sock_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SOCKS SEC(".maps");

/* Unconnected UDP sockets' flows (sock.h): (socket, frontend) -> the backend its datagrams to that frontend go to,
 * while they keep coming (one flow per 5-tuple, as conntrack has it for the packet path). LRU as the map above. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_SOCKS);
	__type(key, struct pyproxy_sock_key);
	__type(value, struct pyproxy_sockflow_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SOCKFLOWS SEC(".maps");

/* The answers of unconnected UDP sockets (sock.h): (socket, backend) -> the frontend its sendmsg() asked for, so a
 * datagram received from that backend reads as from the frontend. Apart from PYPROXY_MAP_SOCKS because nothing
 * deletes these (an unconnected socket's close names no peer): only this LRU ages them, and however many a DNS
 * storm of fresh sockets writes, it can evict no connected socket's entry, whose getpeername() would then show
 * the backend. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_SOCKS);
	__type(key, struct pyproxy_sock_key);
	__type(value, struct pyproxy_sock_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SOCKANS SEC(".maps");

/* loadBalancerSourceRanges: (frontend id, source prefix) -> present (value unused). A new flow to a frontend
 * flagged PYPROXY_SVC_F_RANGES needs a match. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, PYPROXY_MAX_SRCRANGES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_srcrange_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SRCRANGES SEC(".maps");

/* Round-robin cursors (rr, wrr), indexed by service id: an array, so the lookup is inlined and the turn one
 * atomic add. A reused id inherits a cursor: harmless, it only says where the next round starts. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PYPROXY_MAX_SERVICES);
	__type(key, __u32);
	__type(value, struct pyproxy_cursor);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_CURSORS SEC(".maps");

/* One frontend's wrr or Maglev table: entry n -> backend, n < its table_size. An array, so a flow's entry is a
 * read in one contiguous block (128 KB for a Maglev table of 16381): a hash map of every table's entries made a new
 * Maglev flow pay two cache misses (its bucket, its element), +60 % over random (bench/sched.py). The template of
 * PYPROXY_MAP_TABLES' inner maps; BPF_F_INNER_MAP lets each have its own size. Key and value by size, not by type
 * (__u32 -> struct pyproxy_backend): a template with BTF types has BTF-derived fields (timer_off: -ENOENT) that
 * 6.1 compares with each inner array's, made by the control plane without BTF (-EINVAL), refusing every table
 * (EINVAL); without BTF on either side they match on every kernel. */
struct pyproxy_table_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_INNER_MAP);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(struct pyproxy_backend));
};

/* The wrr and Maglev tables: service id -> its table (an inner array map). wrr's is the weighted order of one
 * round; Maglev's the lookup table, whose entry a flow's hash picks. The control plane writes only the entries that
 * change (a Maglev table moves about 1/N of them when one of N backends goes); a table of a new size is a new
 * array, filled before it replaces the old one here. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__uint(max_entries, PYPROXY_MAX_SERVICES);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct pyproxy_table_inner);   /* last: a flexible array member */
} PYPROXY_MAP_TABLES SEC(".maps");

/* Per-service traffic counters, indexed by service id; per-CPU so counting needs no atomics. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PYPROXY_MAX_SERVICES);
	__type(key, __u32);
	__type(value, struct pyproxy_svc_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_STATS SEC(".maps");

/* Per-endpoint traffic counters: backend -> the packets and bytes of the Service traffic sent to it, counted
 * beside PYPROXY_MAP_STATS when pyproxy_config.endpoint_counters is set. Keyed by the backend itself: the
 * established path knows only its address and port (the CT entry has no room for an index). The control plane
 * writes an entry, zeroed, when a backend enters PYPROXY_MAP_BACKENDS and deletes it when the backend leaves, so
 * the programs only look up and add (no entry: not counted) and the map holds one entry per endpoint at most.
 * Per-CPU so counting needs no atomics; not preallocated, so it takes no memory while the counters are off. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, PYPROXY_MAX_EPSTATS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_backend);
	__type(value, struct pyproxy_svc_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_EPSTATS SEC(".maps");

/* Datapath event counters (enum pyproxy_counter), for metrics and for telling why packets dropped. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PYPROXY_CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_COUNTERS SEC(".maps");

/* Service id -> the Service port it serves. Never read by the programs: it lets `pyproxy inspect` name
 * frontends and a restarted pyproxy rebuild what it had applied from the maps alone. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_SERVICES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct pyproxy_svc_name);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_NAMES SEC(".maps");

/* The refusals this CPU may still send (struct pyproxy_refusal_bucket, reject.h): per-CPU, so a refusal costs no
 * atomic; one entry serves both families. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pyproxy_refusal_bucket);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_REFUSALS SEC(".maps");

/* Node device (ifindex, host order) -> the IPv4 address (network order) SNAT gives a flow leaving by it: the
 * device's primary address, which MASQUERADE would pick too. Read only where bpf_fib_lookup cannot name the source
 * address itself (pyproxy_config.kernel without PYPROXY_KERNEL_FIB_SRC: before 6.7); the control plane then fills
 * it from netlink and follows address changes (pyproxy/dataplane/bpf/snat.py), and leaves it empty elsewhere.
 * A hash: ifindexes are sparse and grow with every veth ever made. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_DEVADDRS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __be32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_DEVADDRS SEC(".maps");

/* IPv6 (pyproxy/lb6.h): the twins of the maps above, one for each that holds an address, each for the same purpose
 * as its twin. Same capacities; the loader resizes them with their twins' settings (abi.py RESIZABLE). */

/* Frontends: (IPv6 ClusterIP, port, protocol, scope) -> the service (ids shared with IPv4's). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_SERVICES);
	__type(key, struct pyproxy_svc6_key);
	__type(value, struct pyproxy_svc_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SERVICES6 SEC(".maps");

/* Backend slots of IPv6 frontends: (service id, n) -> backend and weight. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_SLOTS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_slot_key);
	__type(value, struct pyproxy_slot6);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SLOTS6 SEC(".maps");

/* Every IPv6 endpoint of every slice, ready or not, with its open flows (lc, sed, nq). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_BACKENDS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_backend6);
	__type(value, struct pyproxy_backend_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_BACKENDS6 SEC(".maps");

/* ClientIP affinity's usable backends of IPv6 frontends: (service id, backend) -> present. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_AFFINITY);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_affinity6_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_AFFINITY6 SEC(".maps");

/* Connection tracking of IPv6 flows: FORWARD, REVERSE, AFFINITY entries and SNAT pairs, as PYPROXY_MAP_CT. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_FLOWS);
	__type(key, struct pyproxy_ct6_key);
	__type(value, struct pyproxy_ct6_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_CT6 SEC(".maps");

/* IPv6 datagrams in fragments whose first fragment was translated: their ports, for the later fragments. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_FRAGS);
	__type(key, struct pyproxy_frag6_key);
	__type(value, struct pyproxy_frag_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_FRAGS6 SEC(".maps");

/* Node sockets the IPv6 socket hooks pointed at a backend -> the frontend they asked for. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_SOCKS);
	__type(key, struct pyproxy_sock6_key);
	__type(value, struct pyproxy_sock6_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SOCKS6 SEC(".maps");

/* Unconnected IPv6 UDP sockets' flows to IPv6 frontends, as PYPROXY_MAP_SOCKFLOWS. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_SOCKS);
	__type(key, struct pyproxy_sock6_key);
	__type(value, struct pyproxy_sockflow6_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SOCKFLOWS6 SEC(".maps");

/* Unconnected IPv6 UDP sockets' answers, as PYPROXY_MAP_SOCKANS. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PYPROXY_MAX_SOCKS);
	__type(key, struct pyproxy_sock6_key);
	__type(value, struct pyproxy_sock6_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SOCKANS6 SEC(".maps");

/* loadBalancerSourceRanges of IPv6 frontends. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, PYPROXY_MAX_SRCRANGES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_srcrange6_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_SRCRANGES6 SEC(".maps");

/* The template of PYPROXY_MAP_TABLES6' inner arrays: n -> struct pyproxy_backend6, by size (see
 * struct pyproxy_table_inner). */
struct pyproxy_table6_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_INNER_MAP);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(struct pyproxy_backend6));
};

/* The wrr and Maglev tables of IPv6 frontends: service id -> its table. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__uint(max_entries, PYPROXY_MAX_SERVICES);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct pyproxy_table6_inner);
} PYPROXY_MAP_TABLES6 SEC(".maps");

/* Per-endpoint counters of IPv6 backends (as PYPROXY_MAP_EPSTATS; --bpf-endpoint-counters). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, PYPROXY_MAX_EPSTATS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pyproxy_backend6);
	__type(value, struct pyproxy_svc_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_EPSTATS6 SEC(".maps");

/* Node device (ifindex) -> the IPv6 address SNAT gives a flow leaving by it, where bpf_fib_lookup cannot name it
 * (as PYPROXY_MAP_DEVADDRS). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PYPROXY_MAX_DEVADDRS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct pyproxy_in6);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_DEVADDRS6 SEC(".maps");

/* The IPv6 programs, by PYPROXY_JUMP6_*: an IPv4 entry point that finds an IPv6 packet tail-calls its IPv6 twin
 * here, so IPv4 packets pay nothing for IPv6 and each family's program is verified on its own (the BCC build's XDP
 * program is at 690,000 of the verifier's million instructions alone). The loader fills them after each load;
 * pinned, so the programs left attached across a restart keep their IPv6 twins (an unpinned program array is
 * emptied when its last file descriptor closes). An empty entry: the tail call falls through, the packet passes. */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, PYPROXY_JUMP6_TC_MAX);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(__u32));
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_JUMP6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, PYPROXY_JUMP6_XDP_MAX);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(__u32));
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} PYPROXY_MAP_XJUMP6 SEC(".maps");

/* The programs' constants (abi.h): connection-tracking timeouts, SNAT ports, the cluster CIDR, whether endpoints
 * are counted, what the kernel offers. The loader always sets them from the settings, the kernel's HZ and its
 * features; these defaults (at HZ=250) only serve a load that does not. */
const volatile struct pyproxy_config pyproxy_config = {
	.ct = {
		.tcp_new = 60 * 250,
		.tcp_established = 86400 * 250,
		.tcp_closing = 3600 * 250,
		.tcp_closed = 10 * 250,
		.udp_new = 30 * 250,
		.udp_established = 120 * 250,
		.shortest = 10 * 250,
		.tcp_syn_recv = 60 * 250,
		.tcp_time_wait = 120 * 250,
		.udp_stream_after = 2 * 250,
	},
	.snat = { .min = 61000, .max = 65535 },
	.cluster = { .addr = 0, .mask = 0 },
	.cluster6 = {},
	.endpoint_counters = 0,
	.kernel = PYPROXY_KERNEL_FIB_SRC,
	.refusal = { .ns_per_refusal = 1000000, .burst = 50 },
	.sock_hostns_only = 0,
	.host_netns = 0,
};

#endif /* PYPROXY_BCC */

#endif
