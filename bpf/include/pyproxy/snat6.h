/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * SNAT (masquerade) of IPv6 flows: snat.h's twin. The same SNAT pair of connection-tracking entries (here in
 * PYPROXY_MAP_CT6), the same port range and the same rules for taking over a port; the node address comes from
 * bpf_fib_lookup with AF_INET6 (BPF_FIB_LOOKUP_SRC where the kernel knows it, else PYPROXY_MAP_DEVADDRS6 by the
 * egress device).
 */
#ifndef PYPROXY_SNAT6_H
#define PYPROXY_SNAT6_H

#include "pyproxy/ct6.h"
#include "pyproxy/snat.h"

#ifndef AF_INET6
#define AF_INET6 10
#endif

/* The address this node sends from toward `be` (pyproxy_snat_addr's twin). 0: none found. */
static __always_inline int pyproxy_snat6_addr(void *ctx, __u32 ifindex, const struct pyproxy_pkt6 *p,
					      const struct pyproxy_backend6 *be, struct pyproxy_in6 *addr)
{
	struct bpf_fib_lookup fib = {
		.family = AF_INET6, .l4_protocol = p->proto, .sport = p->sport, .dport = be->port, .ifindex = ifindex,
	};
	struct pyproxy_in6 *dev;
	long rc;

	__builtin_memcpy(fib.ipv6_src, &p->saddr, sizeof(fib.ipv6_src));
	__builtin_memcpy(fib.ipv6_dst, &be->addr, sizeof(fib.ipv6_dst));
	if (pyproxy_config.kernel & PYPROXY_KERNEL_FIB_SRC) {
		rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH);
		if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_FRAG_NEEDED)
			return 0;
		__builtin_memcpy(addr, fib.ipv6_src, sizeof(*addr));
		return 1;
	}
	rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_FRAG_NEEDED && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return 0;
	dev = bpf_map_lookup_elem(&PYPROXY_MAP_DEVADDRS6, &fib.ifindex);
	if (!dev)
		return 0;
	*addr = *dev;
	return 1;
}

static __always_inline int pyproxy_snat6_reusable(const struct pyproxy_ct6_key *k, const struct pyproxy_ct6_value *v,
						  __u64 now)
{
	return (v->flags & PYPROXY_CT_F_SNAT) && !pyproxy_ct6_live(k, v, now);
}

/* Whether its flow closed, so it may be taken over when no port tried was free (pyproxy_snat_early's twin). */
static __always_inline int pyproxy_snat6_early(const struct pyproxy_ct6_value *v)
{
	return (v->flags & PYPROXY_CT_F_SNAT) && pyproxy_ct_over(v->state);
}

/* One IPv6 SNAT port allocation, as bpf_loop hands it to each try (struct pyproxy_snat_alloc's twin). */
struct pyproxy_snat6_alloc {
	struct pyproxy_ct6_key rk;
	struct pyproxy_ct6_value rv;
	__u64 now;
	__u16 span;     /* 16 bits, as found: the IPv6 programs' stack (with bpf_loop's callback frame) is at 512 bytes */
	__u16 found;
	__be16 own;
	__be16 early;
};

/* Takes `port` if free or reusable, or (`early`) closed (pyproxy_snat_take's twin). */
static __always_inline int pyproxy_snat6_take(struct pyproxy_snat6_alloc *a, __be16 port, int early)
{
	struct pyproxy_ct6_value *old;

	a->rk.dport = port;
	if (!bpf_map_update_elem(&PYPROXY_MAP_CT6, &a->rk, &a->rv, BPF_NOEXIST))
		return 1;
	old = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &a->rk);
	if (!old)
		return 0;
	if (!pyproxy_snat6_reusable(&a->rk, old, a->now) && !(early && pyproxy_snat6_early(old))) {
		if (!a->early && pyproxy_snat6_early(old))
			a->early = port;
		return 0;
	}
	pyproxy_ct6_delete_pair(&a->rk, old);
	return !bpf_map_update_elem(&PYPROXY_MAP_CT6, &a->rk, &a->rv, BPF_NOEXIST);
}

static long pyproxy_snat6_try(__u32 i, void *data)
{
	struct pyproxy_snat6_alloc *a = data;
	__be16 port = i == 0 && a->own ? a->own
				       : bpf_htons(pyproxy_config.snat.min + bpf_get_prandom_u32() % a->span);

	if (pyproxy_snat6_take(a, port, 0)) {
		a->found = 1;
		return 1;
	}
	return 0;
}

/* The last resort, once every try missed: the port of a closed pair a try met (pyproxy_snat_early). A callback of its
 * own, as the tries are, so its code stays out of the program's stack frame (the IPv6 programs' is at the limit). */
static long pyproxy_snat6_try_early(__u32 i, void *data)
{
	struct pyproxy_snat6_alloc *a = data;

	a->found = a->early && pyproxy_snat6_take(a, a->early, 1);
	return 1;
}
#ifdef PYPROXY_BCC
#define PYPROXY_BCC_LOOPS_pyproxy_snat6_try PYPROXY_SNAT_TRIES
#define PYPROXY_BCC_LOOPS_pyproxy_snat6_try_early 1
#endif

/* Records the SNAT pair of the new flow `p` that goes to `be`, from `addr` and a free port (pyproxy_snat_create's
 * twin). Non-zero: no port free. The allocation's key and value then serve the pair's other entry (stack: see
 * pyproxy_ct6_create). */
static __always_inline int pyproxy_snat6_create(const struct pyproxy_pkt6 *p, const struct pyproxy_backend6 *be,
						const struct pyproxy_in6 *addr, __u32 svc_id, __u64 now)
{
	struct pyproxy_snat6_alloc a = {
		.rv = { .nat_addr = p->saddr, .nat_port = p->sport, .state = PYPROXY_CT_ST_NEW,
			.flags = PYPROXY_CT_F_SNAT, .svc_id = svc_id, .epoch = (__u32)now, .last_seen = now },
		.now = now,
		.span = (__u32)pyproxy_config.snat.max - pyproxy_config.snat.min + 1,
		.own = pyproxy_snat_port(p->sport) ? p->sport : 0,
	};
	__be16 port;

	pyproxy_ct6_key_set(&a.rk, &be->addr, addr, be->port, 0, p->proto, PYPROXY_CT_FORWARD);
	bpf_loop(PYPROXY_SNAT_TRIES, pyproxy_snat6_try, &a, 0);
	if (!a.found) {
		bpf_loop(1, pyproxy_snat6_try_early, &a, 0);
		if (!a.found)
			return -1;
		pyproxy_count(PYPROXY_CNT_SNAT_EARLY_REUSE);
	}
	port = a.rk.dport;
	pyproxy_ct6_key_set(&a.rk, &p->saddr, &be->addr, p->sport, be->port, p->proto, PYPROXY_CT_REVERSE);
	a.rv.nat_addr = *addr;
	a.rv.nat_port = port;
	if (bpf_map_update_elem(&PYPROXY_MAP_CT6, &a.rk, &a.rv, BPF_ANY)) {
		pyproxy_ct6_key_set(&a.rk, &be->addr, addr, be->port, port, p->proto, PYPROXY_CT_FORWARD);
		bpf_map_delete_elem(&PYPROXY_MAP_CT6, &a.rk);
		return -1;
	}
	return 0;
}

/* A packet entering the node that may be a backend's reply to an SNATed IPv6 flow (pyproxy_snat_reverse's twin). */
static __always_inline int pyproxy_snat6_reverse(const struct pyproxy_pkt6 *p, struct pyproxy_backend6 *client)
{
	if (!pyproxy_ct6_translate(p, PYPROXY_CT_FORWARD, PYPROXY_CT_F_SNAT, client))
		return 0;
	pyproxy_count(PYPROXY_CNT_REVSNAT);
	return 1;
}

#endif
