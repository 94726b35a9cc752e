/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * SNAT (masquerade): a new flow's source becomes an address of this node and a port of its own, so the
 * backend's replies come back through this node, which gives them their client back. Upstream kube-proxy marks
 * such flows for netfilter's MASQUERADE; here the translation is a pair of connection-tracking entries
 * (abi.h, PYPROXY_CT_F_SNAT), and no packet of the flow goes through netfilter's NAT:
 *
 *   client C:c -> frontend F:f     ingress (TC or XDP): DNAT to backend B:b (lb.h), SNAT pair recorded here
 *   C:c -> B:b                     egress (TC) toward B: the SNAT pair's REVERSE entry puts S:s in the source
 *   B:b -> S:s                     ingress: the SNAT pair's FORWARD entry puts C:c back in the destination
 *   B:b -> C:c                     egress toward C: the Service flow's REVERSE entry puts F:f in the source
 *
 * S is the address the node's routing picks toward B (the route's preferred source, else the outgoing device's
 * address: what MASQUERADE would put), s a free port of the SNAT range (pyproxy_config.snat): the client's own c
 * when it is in the range and free, else a random one; free meaning that no flow holds (B:b, S:s) that is live or
 * in TIME_WAIT (pyproxy_snat_reusable). The source is written on egress, after routing, because a packet arriving
 * with one of the node's own addresses as its source would be dropped by the stack as a martian.
 */
#ifndef PYPROXY_SNAT_H
#define PYPROXY_SNAT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "pyproxy/ct.h"

#ifndef AF_INET
#define AF_INET 2
#endif

/* Random ports tried for a new flow before it is dropped. With the range half held for one backend, 32 misses in a
 * row happen once in 4e9 new flows; 8 were too few (the packet benchmark's 20,000 flows to 10 backends, 2,000 ports
 * each of 4,536, lost one to four of them). A try costs a lookup only when it misses; bpf_loop keeps the verifier's
 * work to one try's (32 inlined tries exceeded its limit). */
#define PYPROXY_SNAT_TRIES 32

/* Whether `port` (network order) is one SNAT gives out: only then may a packet entering the node be the reply to
 * an SNATed flow. Two compares against constants; non-Service traffic pays nothing more. */
static __always_inline int pyproxy_snat_port(__be16 port)
{
	__u16 p = bpf_ntohs(port);

	return p >= pyproxy_config.snat.min && p <= pyproxy_config.snat.max;
}

/* The address this node sends from toward `be`, as its routing picks it. 0: none, and no SNAT (the backend is
 * this node itself, delivered locally; or no route, and the stack drops the packet anyway). `ifindex` is the
 * device the packet came in on: the lookup is the forwarding one the stack will make.
 * Where bpf_fib_lookup knows BPF_FIB_LOOKUP_SRC (PYPROXY_KERNEL_FIB_SRC) it names the address: the route's preferred
 * source, else the egress device's address. Older kernels refuse that flag (-EINVAL, every packet): there a plain
 * lookup names the egress device and PYPROXY_MAP_DEVADDRS its primary address, MASQUERADE's choice (a route's
 * `src` is not honoured there). Without BPF_FIB_LOOKUP_SKIP_NEIGH a next hop not yet resolved answers NO_NEIGH, the
 * route and device found all the same. The verifier folds the test: each kernel runs one branch. */
static __always_inline __be32 pyproxy_snat_addr(void *ctx, __u32 ifindex, const struct pyproxy_pkt *p,
						const struct pyproxy_backend *be)
{
	struct bpf_fib_lookup fib = {
		.family = AF_INET, .l4_protocol = p->proto, .sport = p->sport, .dport = be->port,
		.ipv4_src = p->saddr, .ipv4_dst = be->addr, .ifindex = ifindex,
	};
	__be32 *addr;
	long rc;

	if (pyproxy_config.kernel & PYPROXY_KERNEL_FIB_SRC) {
		rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH);
		/* FRAG_NEEDED (TC: the skb is larger than the route's MTU) still found the route and its source. */
		if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_FRAG_NEEDED)
			return 0;
		return fib.ipv4_src;
	}
	rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), 0);
	/* FRAG_NEEDED comes after the egress device is set (TC checks the skb's length once the route is found). */
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_FRAG_NEEDED && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return 0;
	addr = bpf_map_lookup_elem(&PYPROXY_MAP_DEVADDRS, &fib.ifindex);
	return addr ? *addr : 0;
}

/* Whether the SNAT pair entry `v` under `k` may be taken over by a new flow: its flow is over and gone (no packet
 * within its state's timeout). A pair in TIME_WAIT is not, though its flow has closed: the backend may still hold
 * TIME_WAIT on the tuple, and refuse a new client's SYN on it (pyproxy_snat_early). */
static __always_inline int pyproxy_snat_reusable(const struct pyproxy_ct_key *k, const struct pyproxy_ct_value *v,
						 __u64 now)
{
	return (v->flags & PYPROXY_CT_F_SNAT) && !pyproxy_ct_live(k, v, now);
}

/* Whether the SNAT pair entry `v` may be taken over when no port tried was free nor reusable: its flow closed, by a
 * RST or by FINs both ways. Better than dropping the new flow: a backend still in TIME_WAIT on the tuple answers
 * the SYN with an ACK of the old connection, the client's RST clears it, and its next SYN gets through. */
static __always_inline int pyproxy_snat_early(const struct pyproxy_ct_value *v)
{
	return (v->flags & PYPROXY_CT_F_SNAT) && pyproxy_ct_over(v->state);
}

/* One SNAT port allocation, as bpf_loop hands it to each try. */
struct pyproxy_snat_alloc {
	struct pyproxy_ct_key rk;      /* the SNAT pair's FORWARD key, but its port */
	struct pyproxy_ct_value rv;    /* its value */
	__u64 now;
	__u16 span;                    /* ports in the range: at most 64,512 (1024-65535) */
	__u16 found;                   /* set by the try that took rk.dport */
	__be16 own;                    /* the client's own port, tried first when it is in the range; else 0 */
	__be16 early;                  /* a port whose pair may be taken over early (pyproxy_snat_early); 0: none */
};

/* Takes port `port` for the allocation `a` if no entry holds it, or if the one that does may be taken over
 * (`early`: also one that closed but has not expired). Returns 1 when taken. */
static __always_inline int pyproxy_snat_take(struct pyproxy_snat_alloc *a, __be16 port, int early)
{
	struct pyproxy_ct_value *old;

	a->rk.dport = port;
	/* The reply side, and only where no entry is: that is what makes the port this flow's. */
	if (!bpf_map_update_elem(&PYPROXY_MAP_CT, &a->rk, &a->rv, BPF_NOEXIST))
		return 1;
	old = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &a->rk);
	if (!old)
		return 0;
	if (!pyproxy_snat_reusable(&a->rk, old, a->now) && !(early && pyproxy_snat_early(old))) {
		if (!a->early && pyproxy_snat_early(old))
			a->early = port;
		return 0;
	}
	pyproxy_ct_delete_pair(&a->rk, old);
	return !bpf_map_update_elem(&PYPROXY_MAP_CT, &a->rk, &a->rv, BPF_NOEXIST);
}

/* One try (a bpf_loop callback, so the verifier checks it once however many tries run): the client's own port
 * first (nf_nat's and Cilium's choice: the backend sees the port the client used), then random ports of the range.
 * Returns 1 to stop the loop. */
static long pyproxy_snat_try(__u32 i, void *data)
{
	struct pyproxy_snat_alloc *a = data;
	__be16 port = i == 0 && a->own ? a->own
				       : bpf_htons(pyproxy_config.snat.min + bpf_get_prandom_u32() % a->span);

	if (pyproxy_snat_take(a, port, 0)) {
		a->found = 1;
		return 1;
	}
	return 0;
}

/* The last resort, once every try missed: the port of a closed pair a try met (pyproxy_snat_early). A callback of its
 * own, as the tries are, so its code stays out of the program's stack frame (the IPv6 programs' is at the limit). */
static long pyproxy_snat_try_early(__u32 i, void *data)
{
	struct pyproxy_snat_alloc *a = data;

	a->found = a->early && pyproxy_snat_take(a, a->early, 1);
	return 1;
}

/* Records the SNAT pair of the new flow `p` (client -> frontend) that goes to `be`, from `addr` and a free port.
 * Returns non-zero when no port was free (or the table refused): the caller drops the packet, and the client's
 * retransmission tries again. Both entries of the pair hold the flow's beginning (abi.h). */
static __always_inline int pyproxy_snat_create(const struct pyproxy_pkt *p, const struct pyproxy_backend *be,
					       __be32 addr, __u32 svc_id, __u64 now)
{
	struct pyproxy_snat_alloc a = {
		.rk = { .saddr = be->addr, .daddr = addr, .sport = be->port, .proto = p->proto,
			.dir = PYPROXY_CT_FORWARD },
		.rv = { .nat_addr = p->saddr, .nat_port = p->sport, .state = PYPROXY_CT_ST_NEW,
			.flags = PYPROXY_CT_F_SNAT, .svc_id = svc_id, .epoch = (__u32)now, .last_seen = now },
		.now = now,
		.span = (__u32)pyproxy_config.snat.max - pyproxy_config.snat.min + 1,
		.own = pyproxy_snat_port(p->sport) ? p->sport : 0,
	};
	struct pyproxy_ct_key ek = {
		.saddr = p->saddr, .daddr = be->addr, .sport = p->sport, .dport = be->port, .proto = p->proto,
		.dir = PYPROXY_CT_REVERSE,
	};
	struct pyproxy_ct_value ev = {
		.nat_addr = addr, .state = PYPROXY_CT_ST_NEW, .flags = PYPROXY_CT_F_SNAT, .svc_id = svc_id,
		.epoch = (__u32)now, .last_seen = now,
	};

	bpf_loop(PYPROXY_SNAT_TRIES, pyproxy_snat_try, &a, 0);
	if (!a.found) {
		bpf_loop(1, pyproxy_snat_try_early, &a, 0);
		if (!a.found)
			return -1;
		pyproxy_count(PYPROXY_CNT_SNAT_EARLY_REUSE);
	}
	ev.nat_port = a.rk.dport;
	if (bpf_map_update_elem(&PYPROXY_MAP_CT, &ek, &ev, BPF_ANY)) {
		bpf_map_delete_elem(&PYPROXY_MAP_CT, &a.rk);
		return -1;
	}
	return 0;
}

/* A packet entering the node that may be a backend's reply to an SNATed flow (its destination port is an SNAT
 * port): when the SNAT pair's FORWARD entry has its tuple, *client gets the address to put back in its
 * destination. */
static __always_inline int pyproxy_snat_reverse(const struct pyproxy_pkt *p, struct pyproxy_backend *client)
{
	if (!pyproxy_ct_translate(p, PYPROXY_CT_FORWARD, PYPROXY_CT_F_SNAT, client))
		return 0;
	pyproxy_count(PYPROXY_CNT_REVSNAT);
	return 1;
}

#endif
