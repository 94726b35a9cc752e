/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * The one definition of everything the BPF programs and the Python control plane share: map names,
 * map key/value structs, flags and counter indices. pyproxy/dataplane/bpf/abi.py mirrors each struct by
 * name; tests/priv/test_abi.py compares both against the BTF of the compiled object.
 *
 * Rules: every struct is padded explicitly so its size has no hidden holes (hash keys are compared
 * bytewise, so a hole would make equal keys differ); byte order is stated per field; a layout change
 * bumps the map's _vN suffix so a restarted pyproxy never reuses a pinned map of the old shape.
 */
#ifndef PYPROXY_ABI_H
#define PYPROXY_ABI_H

#include <linux/types.h>

/* Map names (also the pin file names). Kernel object names hold 15 characters. */
#define PYPROXY_MAP_SERVICES  pyproxy_svc_v2   /* v2: affinity in ticks, not seconds */
#define PYPROXY_MAP_SLOTS     pyproxy_slot_v1
#define PYPROXY_MAP_BACKENDS  pyproxy_be_v1
#define PYPROXY_MAP_CT        pyproxy_ct_v3    /* v2: last_seen in ticks, not ns; v3: the sender's sequence (ct.h,
                                                * the RST window), entries of v2 carried over at start */
#define PYPROXY_MAP_STATS     pyproxy_stat_v1
#define PYPROXY_MAP_COUNTERS  pyproxy_cnt_v5   /* v2: connection-tracking, ICMP and fragment counters; v3: SNAT;
                                                * v4: SNAT ports reused early; v5: out-of-window RSTs */
#define PYPROXY_MAP_NAMES     pyproxy_name_v1
#define PYPROXY_MAP_EPOCH     pyproxy_epoch_v1
#define PYPROXY_MAP_HPIN      pyproxy_hpin_v1
#ifndef PYPROXY_MAP_FRAGS             /* -DPYPROXY_MAP_FRAGS=pyproxy_frag_v9: bench/restarts.py's stand-in for a newer
                                      * release whose one map changed layout (abi.py: PYPROXY_TEST_MAP_FRAGS) */
#define PYPROXY_MAP_FRAGS     pyproxy_frag_v1
#endif
#define PYPROXY_MAP_PORTS     pyproxy_port_v1
#define PYPROXY_MAP_SOCKS     pyproxy_sock_v1
#define PYPROXY_MAP_SOCKFLOWS pyproxy_sflow_v1
#define PYPROXY_MAP_SOCKANS   pyproxy_sans_v1
#define PYPROXY_MAP_SRCRANGES pyproxy_range_v1
#define PYPROXY_MAP_CURSORS   pyproxy_rr_v1
#define PYPROXY_MAP_TABLES    pyproxy_tbl_v3   /* v2: an array per frontend (map in map); v3: its inner
                                                * template without BTF (maps.h), which 6.1 needs */
#define PYPROXY_MAP_EPSTATS   pyproxy_epstat_v1
#define PYPROXY_MAP_DEVADDRS  pyproxy_dev_v1
#define PYPROXY_MAP_AFFINITY  pyproxy_aff_v1
#define PYPROXY_MAP_REFUSALS  pyproxy_refuse_v1   /* both families */
/* IPv6 (README, "IPv6 in bpf mode"): the twins of the maps above whose keys or values hold an address. Frontends of
 * both families share one service id space, so the maps indexed by service id (stats, names, cursors), the epoch,
 * the endpoint ports and the counters serve both. */
#define PYPROXY_MAP_SERVICES6  pyproxy_svc6_v1
#define PYPROXY_MAP_SLOTS6     pyproxy_slot6_v1
#define PYPROXY_MAP_BACKENDS6  pyproxy_be6_v1
#define PYPROXY_MAP_CT6        pyproxy_ct6_v2   /* v2: the sender's sequence, as pyproxy_ct_v3 */
#define PYPROXY_MAP_FRAGS6     pyproxy_frag6_v1
#define PYPROXY_MAP_SRCRANGES6 pyproxy_range6_v1
#define PYPROXY_MAP_TABLES6    pyproxy_tbl6_v1
#define PYPROXY_MAP_SOCKS6     pyproxy_sock6_v1
#define PYPROXY_MAP_SOCKFLOWS6 pyproxy_sflow6_v1
#define PYPROXY_MAP_SOCKANS6   pyproxy_sans6_v1
#define PYPROXY_MAP_DEVADDRS6  pyproxy_dev6_v1
#define PYPROXY_MAP_EPSTATS6   pyproxy_epstat6_v1
#define PYPROXY_MAP_AFFINITY6  pyproxy_aff6_v1
#define PYPROXY_MAP_JUMP6      pyproxy_jmp6_v1  /* TC programs: where the IPv4 programs send IPv6 packets */
#define PYPROXY_MAP_XJUMP6     pyproxy_xjmp6_v1 /* the same for XDP (a program array serves one program type) */

/* Default capacities; the loader may resize before load (bpf_map__set_max_entries). */
#define PYPROXY_MAX_SERVICES  131072   /* frontends: ClusterIP x port x protocol */
#define PYPROXY_MAX_SLOTS     2097152  /* sum over frontends of ready backends */
#define PYPROXY_MAX_BACKENDS  1048576  /* distinct backend ip:port */
#define PYPROXY_MAX_FLOWS     262144   /* connection-tracking entries, two per flow */
#define PYPROXY_MAX_FRAGS     8192     /* datagrams being fragmented through a translation at once */
#define PYPROXY_PORT_WORDS    1024     /* 65536 ports, a bit each */
#define PYPROXY_MAX_SOCKS     65536    /* node sockets pointed at a backend by the socket hooks */
#define PYPROXY_MAX_SRCRANGES 16384    /* loadBalancerSourceRanges entries over all frontends */
#define PYPROXY_MAX_EPSTATS   PYPROXY_MAX_BACKENDS   /* one per backend; the loader keeps it the backends map's size */
#define PYPROXY_MAX_DEVADDRS  4096     /* node devices holding an IPv4 address (PYPROXY_MAP_DEVADDRS) */
#define PYPROXY_MAX_AFFINITY  PYPROXY_MAX_SLOTS   /* the slots of frontends with ClientIP affinity; the loader keeps
						 * it the slots map's size */

/* Entries of PYPROXY_MAP_JUMP6 and PYPROXY_MAP_XJUMP6: the IPv6 programs, which the loader puts there after load. */
#define PYPROXY_JUMP6_TC_INGRESS 0
#define PYPROXY_JUMP6_TC_EGRESS  1
#define PYPROXY_JUMP6_XDP        0
#define PYPROXY_JUMP6_TC_MAX     2
#define PYPROXY_JUMP6_XDP_MAX    1

/* The mark TC ingress leaves on a packet it translated (DNAT to a backend, an SNATed reply given its client back, an
 * ICMP error given its quote), so that the same packet's next TC ingress pass takes it as done. A device stacked
 * over another runs TC ingress on the very skb again, after the rewrite: a bridge after its port, a macvlan or a
 * VLAN after its lower device, a bond after its slave. Unmarked, that second pass would see a packet to an endpoint
 * that no Service flow explains and take it for a direct connection (ct.h, pyproxy_ct_untrack, removes the new
 * flow: its replies would leave untranslated). pyproxy attaches to one device of such a stack by default (README,
 * "The device rule"); the mark is what makes `--devices` naming several of them, or pods' veths and their bridge,
 * safe.
 *
 * It is skb->tc_index, which neither routing nor netfilter reads (Cilium keeps its "skip nodeport" flags there;
 * skb->mark also survives the stack, but CNIs, Istio and kube-proxy own its bits, and policy routing reads it). The
 * kernel writes the whole field when a TC hook's filter returns TC_ACT_OK: tc_index becomes the low 16 bits of the
 * classid, __sk_buff.tc_classid, whatever the program wrote to tc_index itself. So the program writes tc_classid,
 * the mark is a value rather than a bit, and it lasts until the next TC hook the packet passes (the upper device's
 * ingress, or the egress of the device it leaves by), which writes it again. Measured on 6.18 and Debian's 6.1
 * (bridge port -> bridge, macvlan lower -> macvlan; on 6.1 also VLAN parent -> VLAN): the value reaches the upper
 * device's TC ingress; a write to tc_index does not. */
#define PYPROXY_TC_TRANSLATED 0x7079   /* "py" */

/* struct pyproxy_svc_value.flags */
#define PYPROXY_SVC_F_AFFINITY  0x1    /* ClientIP session affinity: a client keeps its backend while that is one of
					* the frontend's slots (PYPROXY_MAP_AFFINITY) */
#define PYPROXY_SVC_F_DROP      0x2    /* no backend: drop, not reject (external/internalTrafficPolicy Local, no
                                        * local endpoint while the cluster has some: the client waits) */
#define PYPROXY_SVC_F_RANGES    0x4    /* new flows only from the frontend's source ranges (PYPROXY_MAP_SRCRANGES) */
#define PYPROXY_SVC_F_MASQ      0x8    /* new flows are SNATed to this node (externalTrafficPolicy Cluster): snat.h */
#define PYPROXY_SVC_F_NODE_VIEW 0x10   /* the node's own sockets use the entry of scope PYPROXY_SVC_SCOPE_NODE */
#define PYPROXY_SVC_F_MASQ_OUTSIDE 0x20 /* new flows from outside the cluster CIDR (pyproxy_config.cluster) are
					 * SNATed: a ClusterIP with --cluster-cidr, as upstream */
#define PYPROXY_SVC_F_SOCK_PODS 0x40   /* a pod's connect() or send may be translated at the socket (sock.h): the
					* model found the result is what the packet path gives that pod (no SNAT, no
					* source ranges). Clear: a pod's call is left untouched, for TC on its veth */
#define PYPROXY_SVC_F_NODE_DENIED 0x80 /* the node's own connections are dropped: its source ranges leave out the
					* node's primary address (ServicePortState.node_denied) */

/* struct pyproxy_svc_value.sched: how a new flow's backend is chosen (sched.h; README, "Schedulers"). Zero is
 * random, so entries written before schedulers existed (a zero pad) keep today's choice. */
#define PYPROXY_SCHED_RANDOM 0         /* uniform random among the slots */
#define PYPROXY_SCHED_RR     1         /* round robin: the frontend's cursor (PYPROXY_MAP_CURSORS) over the slots */
#define PYPROXY_SCHED_WRR    2         /* weighted round robin: the cursor over the frontend's table */
#define PYPROXY_SCHED_LC     3         /* least connections: fewest active flows (pyproxy_backend_info.active) */
#define PYPROXY_SCHED_SED    4         /* shortest expected delay: least (active + 1) / weight */
#define PYPROXY_SCHED_NQ     5         /* never queue: an idle backend if there is one, else as SED */
#define PYPROXY_SCHED_SH     6         /* source hashing: the client's address picks the slot */
#define PYPROXY_SCHED_DH     7         /* destination hashing: the frontend's address picks the slot */
#define PYPROXY_SCHED_MAGLEV 8         /* Maglev: the flow's hash picks an entry of the frontend's table */

/* struct pyproxy_svc_key.scope: whose traffic an entry serves. The packet path looks up PACKETS only. An external
 * frontend with externalTrafficPolicy Local serves clients from outside with this node's endpoints, and the
 * node's own processes with every endpoint (upstream's short circuit): its NODE entry, with slots of its own. A
 * NodePort on 127.0.0.1 (localhostNodePorts) has a HOST entry only: the socket hooks look a loopback destination
 * up there, and no packet can meet it (one to 127.0.0.1 arriving on a device is a neighbour's: CVE-2020-8558). */
#define PYPROXY_SVC_SCOPE_PACKETS 0
#define PYPROXY_SVC_SCOPE_NODE    1
#define PYPROXY_SVC_SCOPE_HOST    2

/* struct pyproxy_ct_key.dir */
#define PYPROXY_CT_FORWARD  0          /* client -> frontend, value holds the backend */
#define PYPROXY_CT_REVERSE  1          /* backend -> client, value holds the frontend to restore */
#define PYPROXY_CT_AFFINITY 2          /* client -> frontend with ports zeroed: ClientIP affinity */
#define PYPROXY_CT_HAIRPIN  3          /* pod -> frontend with ports zeroed: the socket hook chose the pod itself for
					* a connect() it leaves to TC (sock.h); TC takes that choice once, within
					* pyproxy_ct_timeouts.shortest (lb.h) */

/* struct pyproxy_ct_value.state: where a flow is in its life, which picks its idle timeout (ct.h draws the
 * machine). Both entries of a flow (FORWARD and REVERSE) carry it; a packet that changes it writes both. Zero is
 * "established" so that entries written before states existed (a zero pad) stay valid through an upgrade; the
 * states after CLOSED came later, so older programs never wrote them. */
#define PYPROXY_CT_ST_ESTABLISHED 0    /* TCP: the client's packet after the SYN-ACK was seen; UDP: a stream */
#define PYPROXY_CT_ST_NEW         1    /* no reply yet (TCP: SYN sent) */
#define PYPROXY_CT_ST_CLOSING     2    /* TCP: a FIN in one direction (half-closed) */
#define PYPROXY_CT_ST_CLOSED      3    /* TCP: a RST: lingers for late segments */
#define PYPROXY_CT_ST_SYN_RECV    4    /* TCP: the backend's SYN-ACK seen, not yet the client's ACK (a half-open
					* flow: a flood of them expires in the SYN timeout, not the established one);
					* UDP: replied, not yet a stream (a single exchange, the kernel's 30 s) */
#define PYPROXY_CT_ST_TIME_WAIT   5    /* TCP: FINs in both directions: the backend may hold TIME_WAIT on the
					* tuple, so an SNAT pair's port is not handed out again before it expires */

/* struct pyproxy_ct_value.flags: the FINs seen, so the second one closes the flow. */
#define PYPROXY_CT_F_FIN_FWD 0x1       /* client -> frontend */
#define PYPROXY_CT_F_FIN_REV 0x2       /* backend -> client */
/* The flags of the flow rather than of one entry: a packet that changes them writes them to both entries (ct.h);
 * the others say what an entry is (MASQ on a Service flow's FORWARD entry only, SNAT on an SNAT pair's, COUNTED
 * on the entry counted) and stay as the entry was made. */
#define PYPROXY_CT_F_FLOW    (PYPROXY_CT_F_FIN_FWD | PYPROXY_CT_F_FIN_REV)
/* The flow's source is translated too (masquerade, snat.h). A Service flow so translated has a second pair of
 * entries, the SNAT pair, mirrored: its REVERSE entry is keyed as the client's packets leave toward the backend
 * (client -> backend; holds the node's address and port to put in the source) and its FORWARD entry as the
 * backend's replies arrive (backend -> node address and port; holds the client to put back in the
 * destination). So the egress program's one lookup translates both the replies to clients and the
 * masqueraded packets to backends, and the SNAT pair expires, refreshes and is collected like any pair. */
#define PYPROXY_CT_F_MASQ    0x4       /* a Service flow's FORWARD entry: the flow has an SNAT pair */
#define PYPROXY_CT_F_SNAT    0x8       /* an entry of an SNAT pair */
#define PYPROXY_CT_F_COUNTED 0x10      /* a Service flow counted in its backend's active flows (lc, sed, nq) */
/* Neither entry knows its sender's sequence (pyproxy_ct_value.seq_end): a flow carried over from a map of the layout
 * before it (pyproxy_ct_v2, pyproxy_ct6_v1; loader.py sets it on both entries), on which any RST closes the flow as
 * it did before the RST window. Both entries of a flow carry it alike, like every flag; no program sets it. */
#define PYPROXY_CT_F_SEQ_UNKNOWN 0x20

/* Indices of PYPROXY_MAP_COUNTERS (per-CPU __u64 each). */
enum pyproxy_counter {
	PYPROXY_CNT_NEW_FLOW = 0,      /* a new flow was assigned a backend */
	PYPROXY_CNT_ESTABLISHED,       /* a packet followed an existing flow's backend */
	PYPROXY_CNT_REVNAT,            /* a reply got its frontend address back */
	PYPROXY_CNT_NO_BACKEND,        /* refused: frontend with no usable backend (reject.h) */
	PYPROXY_CNT_REBALANCED,        /* a flow's backend was gone, a new one was chosen */
	PYPROXY_CNT_SLOT_MISS,         /* dropped: slot missing (control plane mid-update) */
	PYPROXY_CNT_CT_FULL,           /* a flow could not be recorded (map update failed) */
	PYPROXY_CNT_CT_EXPIRED,        /* a packet found its flow's entry expired and was treated as new */
	PYPROXY_CNT_CT_REOPENED,       /* a SYN on a flow past its handshake started a new connection */
	PYPROXY_CNT_CT_UNTRACKED,      /* a packet that is no Service's removed an old flow's reverse entry */
	PYPROXY_CNT_ICMP_NAT,          /* an ICMP error about a translated flow was translated */
	PYPROXY_CNT_FRAG_NAT,          /* a non-first fragment followed its datagram's translation */
	PYPROXY_CNT_SOCK_LB,           /* a node socket's connect or send to a frontend went to a backend */
	PYPROXY_CNT_SOCK_REFUSED,      /* ... refused: the frontend has no usable endpoint */
	PYPROXY_CNT_NO_LOCAL,          /* dropped: externalTrafficPolicy Local and no endpoint on this node */
	PYPROXY_CNT_SOURCE_DENIED,     /* dropped: a new flow from outside the frontend's source ranges */
	PYPROXY_CNT_SNAT,              /* a new flow's source was translated to a node address and port */
	PYPROXY_CNT_SNAT_NO_PORT,      /* dropped: no free SNAT port for the flow's node address and backend */
	PYPROXY_CNT_SNAT_NO_ROUTE,     /* a flow to SNAT had no route to its backend (nor a source address): left as it is */
	PYPROXY_CNT_REVSNAT,           /* a backend's reply to a node address and SNAT port went back to its client */
	PYPROXY_CNT_SNAT_EARLY_REUSE,  /* an SNAT port was handed out while its last flow was in TIME_WAIT: no other
					* port tried was free (the backend may refuse the first SYN: a 1 s retry) */
	PYPROXY_CNT_REFUSAL_LIMITED,   /* dropped, not refused: this CPU's refusals (RST, ICMP) were over their rate */
	PYPROXY_CNT_CT_RST_IGNORED,    /* a RST outside its sender's sequence window left its flow as it was (ct.h) and
					* was passed on to the endpoint, whose stack ignores or challenges it; once per
					* pair of entries it met (an SNATed flow's RST meets two) */
	PYPROXY_CNT_MAX,
};

/* Key of PYPROXY_MAP_SERVICES: one frontend. */
struct pyproxy_svc_key {
	__be32 vip;    /* network byte order */
	__be16 port;   /* network byte order */
	__u8 proto;    /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 scope;    /* PYPROXY_SVC_SCOPE_*; took the place of a zero pad: older entries are PACKETS ones */
};

struct pyproxy_svc_value {
	__u32 svc_id;          /* host order; index into PYPROXY_MAP_STATS and key part of slots */
	__u16 backend_count;   /* host order; backends in slots 0..count-1; 0 = refuse (or drop: F_DROP) */
	__u16 flags;           /* host order; PYPROXY_SVC_F_* */
	__u32 affinity_ticks;  /* host order; ClientIP affinity timeout in ticks (jiffies) when PYPROXY_SVC_F_AFFINITY */
	/* These took the place of a zero pad: older entries read as random with no table. */
	__u8 sched;            /* PYPROXY_SCHED_* */
	__u8 pad;              /* zero */
	__u16 table_size;      /* host order; entries of its table in PYPROXY_MAP_TABLES (wrr, maglev); 0: none */
};

/* Key of PYPROXY_MAP_SLOTS: the n-th ready backend of a frontend. */
struct pyproxy_slot_key {
	__u32 svc_id;  /* host order */
	__u32 slot;    /* host order, 0..backend_count-1 */
};

/* A backend address: key of PYPROXY_MAP_BACKENDS, value of a PYPROXY_MAP_TABLES table. */
struct pyproxy_backend {
	__be32 addr;   /* network byte order */
	__be16 port;   /* network byte order */
	__u16 pad;     /* zero */
};

/* Key of PYPROXY_MAP_AFFINITY: a backend in the slots of one frontend with ClientIP affinity (value: a __u32,
 * unused). */
struct pyproxy_affinity_key {
	__u32 svc_id;                 /* host order */
	struct pyproxy_backend be;    /* its pad zero */
};

/* Value of PYPROXY_MAP_SLOTS: a backend and its weight for this frontend. A struct pyproxy_backend until
 * weights came; its pad became the weight, so older entries read as weight 0, which counts as 1. */
struct pyproxy_slot {
	__be32 addr;   /* network byte order */
	__be16 port;   /* network byte order */
	__u16 weight;  /* host order; 1-100 (sed, nq); 0 = 1 */
};

/* Value of PYPROXY_MAP_BACKENDS: the backend is an endpoint of some slice (ready or not). */
struct pyproxy_backend_info {
	__u32 flags;   /* host order; reserved, zero */
	/* host order; flows of lc/sed/nq frontends to this backend that are open (not closed, not deleted): the
	 * programs add one when they record such a flow (PYPROXY_CT_F_COUNTED) and take it back when it closes or
	 * is deleted; the control plane's collector recounts it from the CT map after each pass, which corrects
	 * flows the LRU evicted or the collector deleted (gc.py). Took the place of a zero pad. Signed: a recount
	 * racing a close can leave it one low for a pass; the schedulers read a negative count as 0. */
	__s32 active;
};

/* Key of PYPROXY_MAP_CT: a flow as seen on the wire in one direction. */
struct pyproxy_ct_key {
	__be32 saddr;  /* network byte order */
	__be32 daddr;  /* network byte order */
	__be16 sport;  /* network byte order */
	__be16 dport;  /* network byte order */
	__u8 proto;    /* IPPROTO_* */
	__u8 dir;      /* PYPROXY_CT_* */
	__u16 pad;     /* zero */
};

struct pyproxy_ct_value {
	__be32 nat_addr;   /* network order; FORWARD: backend, REVERSE: frontend VIP */
	__be16 nat_port;   /* network order */
	__u8 state;        /* PYPROXY_CT_ST_*; took the place of a zero pad (see above) */
	__u8 flags;        /* PYPROXY_CT_F_* */
	__u32 svc_id;      /* host order; the frontend this flow belongs to */
	/* host order. A Service flow's FORWARD entry: the backends epoch (PYPROXY_MAP_EPOCH) at which the backend was
	 * last seen to be an endpoint. It took the place of a zero pad with no version bump: entries of older versions
	 * read as 0, an epoch the control plane never makes current, so they are checked once and connections
	 * survive. Every other entry (a Service flow's REVERSE entry, both entries of an SNAT pair): the low 32 bits
	 * of the tick its flow began, which UDP's stream rule reads (ct.h; 0 in older entries: long begun). */
	__u32 epoch;
	__u64 last_seen;   /* host order; jiffies (bpf_jiffies64) of its last packet */
	/* host order. TCP: the end (seq + payload + SYN + FIN) of the furthest segment this entry's sender sent, which a
	 * RST from that sender must lie near to close the flow (ct.h, "The RST window"). Learnt from the sender's
	 * packets while the flow is NEW (its first one), moved on by later ones; meaningless under
	 * PYPROXY_CT_F_SEQ_UNKNOWN. */
	__u32 seq_end;
	__u32 pad;         /* zero */
};

/* Idle timeouts of connection-tracking entries, in ticks, by state. A constant of the loaded programs
 * (.rodata, set by the loader from the settings in seconds and the kernel's HZ), so the verifier folds it
 * into the code and no packet pays a lookup for it. AFFINITY entries use their Service's timeout. */
struct pyproxy_ct_timeouts {
	__u32 tcp_new;           /* TCP, SYN sent, no reply yet */
	__u32 tcp_established;   /* TCP, handshake complete */
	__u32 tcp_closing;       /* TCP, a FIN in one direction */
	__u32 tcp_closed;        /* TCP, a RST */
	__u32 udp_new;           /* UDP, no reply yet; also replied but not yet a stream (the kernel's udp_timeout) */
	__u32 udp_established;   /* UDP, a stream: replied, and a packet more than udp_stream_after after it began */
	__u32 shortest;          /* the smallest timeout here: an entry idle for less is live in any state */
	__u32 tcp_syn_recv;      /* TCP, SYN-ACK seen, no ACK from the client yet (took the place of a zero pad) */
	__u32 tcp_time_wait;     /* TCP, FINs both ways */
	__u32 udp_stream_after;  /* not a timeout: how long after it began a replied UDP flow becomes a stream */
};

/* The source ports SNAT takes (host order, inclusive). Chosen outside the kernel's ephemeral range
 * (net.ipv4.ip_local_port_range), so no node socket gets one of them unless it binds it explicitly: a reply
 * to a node address and one of these ports is then an SNATed flow's (README, "SNAT"). */
struct pyproxy_snat_ports {
	__u16 min;
	__u16 max;
	__u32 pad;     /* zero */
};

/* An IPv6 address: four words, each in network byte order (the sixteen bytes as they sit in the packet). */
struct pyproxy_in6 {
	__be32 w[4];   /* network byte order */
};

/* An IPv4 prefix: the cluster CIDR (--cluster-cidr). mask 0: none given. */
struct pyproxy_cidr {
	__be32 addr;   /* network byte order; the network address */
	__be32 mask;   /* network byte order */
};

/* struct pyproxy_config.kernel: what the running kernel offers beyond what pyproxy requires, probed by the loader
 * (pyproxy/dataplane/bpf/kernel.py). A clear bit makes the programs take their older kernels' way; the verifier
 * folds the test, so each kernel runs only its own branch. */
#define PYPROXY_KERNEL_FIB_SRC 0x1     /* bpf_fib_lookup knows BPF_FIB_LOOKUP_SRC and BPF_FIB_LOOKUP_SKIP_NEIGH (mainline
					* 6.7; 6.1.81 and later 6.1 stable kernels): it names SNAT's source address.
					* Else SNAT takes the egress device's address from PYPROXY_MAP_DEVADDRS (snat.h) */

/* The programs' constants: the .rodata variable the loader sets before load (the verifier then folds each read
 * into the code). */
/* An IPv6 prefix: the cluster CIDR's IPv6 half (dual stack). mask 0: none given. */
struct pyproxy_cidr6 {
	struct pyproxy_in6 addr;   /* the network address */
	struct pyproxy_in6 mask;
};

/* Value of PYPROXY_MAP_REFUSALS (per-CPU, one entry): a token bucket of the refusals (reject.h) this CPU may send,
 * kept as time: credit grows by the nanoseconds that pass, up to a burst's worth, and each refusal spends one
 * refusal's worth (pyproxy_config.refusal). */
struct pyproxy_refusal_bucket {
	__u64 credit_ns;   /* host order */
	__u64 last_ns;     /* host order; bpf_ktime_get_ns() of the last refusal asked for */
};

/* struct pyproxy_config.refusal: how many refusals each CPU may send, as the kernel limits its own ICMP errors
 * (net.ipv4.icmp_msgs_per_sec, icmp_msgs_burst): a flood to a frontend without endpoints is not answered one for
 * one. */
struct pyproxy_refusal_rate {
	__u32 ns_per_refusal;   /* the time one refusal costs: 1e9 / refusals per second */
	__u32 burst;            /* refusals the bucket holds */
};

struct pyproxy_config {
	struct pyproxy_ct_timeouts ct;
	struct pyproxy_snat_ports snat;
	struct pyproxy_cidr cluster;
	/* 1: count each backend's packets and bytes (PYPROXY_MAP_EPSTATS, --bpf-endpoint-counters). A constant, so
	 * with 0 the verifier removes the count and its lookup from the programs: off costs nothing per packet. */
	__u32 endpoint_counters;
	__u32 kernel;  /* PYPROXY_KERNEL_* */
	__u32 pad;     /* zero */
	struct pyproxy_cidr6 cluster6;   /* appended: .rodata is each load's own, no map keeps the old layout */
	struct pyproxy_refusal_rate refusal;
	/* 1: the socket hooks translate the node's own network namespace only (--bpf-socket-lb-hostns-only): every
	 * pod's calls are left to TC. */
	__u32 sock_hostns_only;
	__u64 host_netns;   /* host order; the node's network namespace cookie (SO_NETNS_COOKIE of the loader) */
};

/* Value of PYPROXY_MAP_CURSORS: a frontend's round-robin position (rr, wrr). */
struct pyproxy_cursor {
	__u32 next;    /* host order; the next flow's turn, taken with an atomic add (wraps) */
	__u32 pad;     /* zero */
};

/* Key of PYPROXY_MAP_FRAGS: one IPv4 datagram in fragments, as its fragments carry it (before translation). */
struct pyproxy_frag_key {
	__be32 saddr;  /* network byte order */
	__be32 daddr;  /* network byte order */
	__be16 id;     /* network byte order; the IPv4 identification */
	__u8 proto;    /* IPPROTO_* */
	__u8 pad;      /* zero */
};

/* Value of PYPROXY_MAP_FRAGS: the ports of the first fragment, which later fragments do not carry. */
struct pyproxy_frag_value {
	__be16 sport;  /* network byte order */
	__be16 dport;  /* network byte order */
	__u32 pad;     /* zero */
};

/* Key of PYPROXY_MAP_SOCKS: a node socket the socket hooks pointed at a backend, and that backend. */
struct pyproxy_sock_key {
	__u64 cookie;  /* host order; bpf_get_socket_cookie() */
	__be32 addr;   /* network byte order; the backend */
	__be16 port;   /* network byte order */
	__u16 pad;     /* zero */
};
/* Value of PYPROXY_MAP_SOCKS: the frontend (ClusterIP and port) the socket asked for, which getpeername() and
 * received datagrams' source addresses show (the layout of a struct pyproxy_backend, whose pad `flags` took). */
struct pyproxy_sock_value {
	__be32 addr;   /* network byte order; the frontend */
	__be16 port;   /* network byte order */
	__u8 flags;    /* PYPROXY_SOCK_F_* */
	__u8 pad;      /* zero */
};
/* pyproxy_sock_value.flags */
#define PYPROXY_SOCK_F_COUNTED 0x1   /* its connect() counted a connection to the key's backend (lc, sed, nq), which
				      * the socket's close (cgroup/sock_release) takes back */

/* PYPROXY_MAP_SOCKFLOWS is keyed by a struct pyproxy_sock_key too, holding the frontend an unconnected UDP socket
 * sends to (sendmsg); its value is the flow that socket has to that frontend. */
struct pyproxy_sockflow_value {
	struct pyproxy_backend be;   /* the backend its datagrams go to */
	__u32 svc_id;      /* host order; the frontend's when chosen */
	__u32 epoch;       /* host order; the backends epoch the backend was last confirmed at */
	__u64 last_seen;   /* host order; jiffies of the last datagram either way */
};

/* Key of PYPROXY_MAP_SRCRANGES (an LPM trie): one source range of one frontend. Looked up with all 64 bits (the
 * frontend's id, then the flow's source): an entry matches the id whole and the source by its prefix. */
struct pyproxy_srcrange_key {
	__u32 prefixlen;  /* host order; 32 + the range's prefix length */
	__be32 svc_id;    /* network byte order, so the trie compares it first and whole */
	__be32 addr;      /* network byte order; the range's network address */
};

/* Value of PYPROXY_MAP_STATS (per-CPU): traffic from clients to one frontend; and of PYPROXY_MAP_EPSTATS
 * (per-CPU): the same traffic counted per backend it went to. */
struct pyproxy_svc_stats {
	__u64 packets;  /* host order */
	__u64 bytes;    /* host order */
};

/* IPv6: the twins of the structs above that hold an address (Cilium's lb4_/lb6_ pairs), each address a struct
 * pyproxy_in6. Service ids, slot keys, backend info, CT states and flags, fragment ports and statistics are the
 * IPv4 structs'. */
/* Key of PYPROXY_MAP_SERVICES6 (value: struct pyproxy_svc_value). */
struct pyproxy_svc6_key {
	struct pyproxy_in6 vip;
	__be16 port;   /* network byte order */
	__u8 proto;    /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 scope;    /* PYPROXY_SVC_SCOPE_* */
};

/* An IPv6 backend: key of PYPROXY_MAP_BACKENDS6 (value: struct pyproxy_backend_info), value of a
 * PYPROXY_MAP_TABLES6 table and of PYPROXY_MAP_SOCKS6 (there: the frontend the socket asked for). */
struct pyproxy_backend6 {
	struct pyproxy_in6 addr;
	__be16 port;   /* network byte order */
	__u16 pad;     /* zero */
};

/* Key of PYPROXY_MAP_AFFINITY6 (pyproxy_affinity_key's twin). */
struct pyproxy_affinity6_key {
	__u32 svc_id;                 /* host order */
	struct pyproxy_backend6 be;   /* its pad zero */
};

/* Value of PYPROXY_MAP_SLOTS6 (key: struct pyproxy_slot_key). */
struct pyproxy_slot6 {
	struct pyproxy_in6 addr;
	__be16 port;   /* network byte order */
	__u16 weight;  /* host order; 1-100 (sed, nq); 0 = 1 */
};

/* Key of PYPROXY_MAP_CT6: a flow as seen on the wire in one direction (PYPROXY_CT_* dir, as IPv4's). */
struct pyproxy_ct6_key {
	struct pyproxy_in6 saddr;
	struct pyproxy_in6 daddr;
	__be16 sport;  /* network byte order */
	__be16 dport;  /* network byte order */
	__u8 proto;    /* IPPROTO_* */
	__u8 dir;      /* PYPROXY_CT_* */
	__u16 pad;     /* zero */
};

/* Value of PYPROXY_MAP_CT6: struct pyproxy_ct_value's fields, with an IPv6 address. */
struct pyproxy_ct6_value {
	struct pyproxy_in6 nat_addr;   /* FORWARD: backend, REVERSE: frontend VIP (SNAT pair: abi.h above) */
	__be16 nat_port;   /* network order */
	__u8 state;        /* PYPROXY_CT_ST_* */
	__u8 flags;        /* PYPROXY_CT_F_* */
	__u32 svc_id;      /* host order */
	__u32 epoch;       /* host order; FORWARD: the backends epoch the backend was last confirmed at */
	__u32 seq_end;     /* host order; as pyproxy_ct_value's. It took the place of a zero pad, yet the map is
			    * versioned (v2): a v1 entry's zero would read as a known sequence (loader.py converts) */
	__u64 last_seen;   /* host order; jiffies */
};

/* Key of PYPROXY_MAP_FRAGS6: one IPv6 datagram in fragments (value: struct pyproxy_frag_value). */
struct pyproxy_frag6_key {
	struct pyproxy_in6 saddr;
	struct pyproxy_in6 daddr;
	__be32 id;     /* network byte order; the fragment header's identification (32 bits in IPv6) */
	__u8 proto;    /* IPPROTO_*: the upper-layer header after the fragment header */
	__u8 pad[3];   /* zero */
};

/* Key of PYPROXY_MAP_SOCKS6: a node socket the IPv6 socket hooks pointed at a backend, and that backend. */
struct pyproxy_sock6_key {
	__u64 cookie;  /* host order */
	struct pyproxy_in6 addr;
	__be16 port;   /* network byte order */
	__u16 pad;     /* zero */
	__u32 pad2;    /* zero */
};

/* Value of PYPROXY_MAP_SOCKS6 (pyproxy_sock_value's twin). */
struct pyproxy_sock6_value {
	struct pyproxy_in6 addr;
	__be16 port;   /* network byte order */
	__u8 flags;    /* PYPROXY_SOCK_F_* */
	__u8 pad;      /* zero */
};

/* Value of PYPROXY_MAP_SOCKFLOWS6 (key: a struct pyproxy_sock6_key holding the frontend): pyproxy_sockflow_value's
 * twin. */
struct pyproxy_sockflow6_value {
	struct pyproxy_backend6 be;
	__u32 svc_id;      /* host order */
	__u32 epoch;       /* host order */
	__u32 pad;         /* zero */
	__u64 last_seen;   /* host order; jiffies */
};

/* Key of PYPROXY_MAP_SRCRANGES6 (an LPM trie): 32 + the range's prefix length, the frontend's id, the range. */
struct pyproxy_srcrange6_key {
	__u32 prefixlen;  /* host order */
	__be32 svc_id;    /* network byte order */
	struct pyproxy_in6 addr;
};

#define PYPROXY_NAME_LEN 128

/* Value of PYPROXY_MAP_NAMES: which Service port a frontend serves, "namespace/name[:port]". */
struct pyproxy_svc_name {
	char name[PYPROXY_NAME_LEN];   /* NUL-terminated */
};

#endif /* PYPROXY_ABI_H */
