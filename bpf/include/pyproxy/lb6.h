/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Load balancing of IPv6 packets: lb.h's twin (pyproxy_lb6_*). The same decisions in the same order, on the IPv6
 * maps: frontend, flow, source ranges, no endpoint, affinity, scheduler (sched.h's address-independent half,
 * pyproxy_sched_pick, is shared), SNAT, flow record. What lb.h says of each step holds here.
 */
#ifndef PYPROXY_LB6_H
#define PYPROXY_LB6_H

#include "pyproxy/lb.h"
#include "pyproxy/ct6.h"
#include "pyproxy/snat6.h"

static __always_inline int pyproxy_lb6_backend_alive(const struct pyproxy_backend6 *be)
{
	return bpf_map_lookup_elem(&PYPROXY_MAP_BACKENDS6, be) != NULL;
}

static __always_inline void pyproxy_lb6_affinity_key(const struct pyproxy_pkt6 *p, struct pyproxy_ct6_key *k)
{
	pyproxy_ct6_key_set(k, &p->saddr, &p->daddr, 0, p->dport, p->proto, PYPROXY_CT_AFFINITY);
}

/* Whether `be` is one of the IPv6 frontend's slots (pyproxy_affinity_usable's twin); `k`: room for the key, the
 * caller's (the IPv6 programs' stack, with bpf_loop's callback frame, is at the verifier's 512 bytes). */
static __always_inline int pyproxy_lb6_affinity_usable(__u32 svc_id, const struct pyproxy_backend6 *be,
						       struct pyproxy_affinity6_key *k)
{
	k->svc_id = svc_id;
	k->be = *be;
	return bpf_map_lookup_elem(&PYPROXY_MAP_AFFINITY6, k) != NULL;
}

/* ClientIP affinity: the backend this client used within the affinity window, if new flows may still use it
 * (pyproxy_affinity_lookup's twin). */
static __always_inline int pyproxy_lb6_affinity_lookup(const struct pyproxy_pkt6 *p,
						       const struct pyproxy_svc_value *svc, __u64 now,
						       struct pyproxy_backend6 *be)
{
	/* One piece of stack for both keys: the flow's, then the frontend's affinity entry. */
	union {
		struct pyproxy_ct6_key ct;
		struct pyproxy_affinity6_key usable;
	} k;
	struct pyproxy_ct6_value *v;

	pyproxy_lb6_affinity_key(p, &k.ct);
	v = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &k.ct);
	if (!v || now - v->last_seen > svc->affinity_ticks)
		return 0;
	be->addr = v->nat_addr;
	be->port = v->nat_port;
	be->pad = 0;
	return pyproxy_lb6_affinity_usable(svc->svc_id, be, &k.usable);
}

static __always_inline void pyproxy_lb6_affinity_record(const struct pyproxy_pkt6 *p,
							const struct pyproxy_backend6 *be, __u32 svc_id, __u64 now)
{
	struct pyproxy_ct6_key k;
	struct pyproxy_ct6_value v = {
		.nat_addr = be->addr, .nat_port = be->port, .svc_id = svc_id, .last_seen = now,
	};

	pyproxy_lb6_affinity_key(p, &k);
	bpf_map_update_elem(&PYPROXY_MAP_CT6, &k, &v, BPF_ANY);
}

/* pyproxy_hairpin_claim's twin. */
static __always_inline void pyproxy_lb6_hairpin_claim(const struct pyproxy_in6 *daddr, __be16 dport, __u8 proto,
						      const struct pyproxy_backend6 *be, __u32 svc_id, __u64 now)
{
	struct pyproxy_ct6_key k;
	struct pyproxy_ct6_value v = {
		.nat_addr = be->addr, .nat_port = be->port, .svc_id = svc_id, .last_seen = now,
	};

	pyproxy_ct6_key_set(&k, &be->addr, daddr, 0, dport, proto, PYPROXY_CT_HAIRPIN);
	bpf_map_update_elem(&PYPROXY_MAP_CT6, &k, &v, BPF_ANY);
	pyproxy_hairpin_mark(now);
}

/* pyproxy_hairpin_claimed's twin. */
static __always_inline int pyproxy_lb6_hairpin_claimed(const struct pyproxy_pkt6 *p, __u64 now,
						       struct pyproxy_ct6_key *k, struct pyproxy_backend6 *be)
{
	struct pyproxy_ct6_value *v;

	if (!pyproxy_hairpin_pending(now))
		return 0;
	pyproxy_ct6_key_set(k, &p->saddr, &p->daddr, 0, p->dport, p->proto, PYPROXY_CT_HAIRPIN);
	v = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, k);
	if (!v)
		return 0;
	*be = (struct pyproxy_backend6){ .addr = v->nat_addr, .port = v->nat_port };
	return pyproxy_hairpin_take(&PYPROXY_MAP_CT6, k, v->last_seen, now) && pyproxy_lb6_backend_alive(be);
}

static __always_inline int pyproxy_lb6_source_allowed(const struct pyproxy_svc_value *svc,
						      const struct pyproxy_in6 *saddr)
{
	struct pyproxy_srcrange6_key k = { .prefixlen = 32 + 128, .svc_id = bpf_htonl(svc->svc_id), .addr = *saddr };

	return bpf_map_lookup_elem(&PYPROXY_MAP_SRCRANGES6, &k) != NULL;
}

static __always_inline struct pyproxy_svc_value *pyproxy_lb6_frontend_in(const struct pyproxy_in6 *vip,
									 __be16 port, __u8 proto, __u8 scope)
{
	struct pyproxy_svc6_key sk = { .vip = *vip, .port = port, .proto = proto, .scope = scope };

	return bpf_map_lookup_elem(&PYPROXY_MAP_SERVICES6, &sk);
}

static __always_inline struct pyproxy_svc_value *pyproxy_lb6_frontend_of(const struct pyproxy_pkt6 *p)
{
	return pyproxy_lb6_frontend_in(&p->daddr, p->dport, p->proto, PYPROXY_SVC_SCOPE_PACKETS);
}

/* The IPv6 frontend's slot `slot`: the backend and its weight (0 reads as 1). */
static __always_inline int pyproxy_lb6_slot_get(__u32 svc_id, __u32 slot, struct pyproxy_backend6 *be,
						__u32 *weight)
{
	struct pyproxy_slot_key sk = { .svc_id = svc_id, .slot = slot };
	struct pyproxy_slot6 *s = bpf_map_lookup_elem(&PYPROXY_MAP_SLOTS6, &sk);

	if (!s)
		return 0;
	be->addr = s->addr;
	be->port = s->port;
	be->pad = 0;
	if (weight)
		*weight = s->weight ? s->weight : 1;
	return 1;
}

static __always_inline int pyproxy_lb6_table_get(__u32 svc_id, __u32 i, struct pyproxy_backend6 *be)
{
	void *table = bpf_map_lookup_elem(&PYPROXY_MAP_TABLES6, &svc_id);
	struct pyproxy_backend6 *t;

	if (!table)
		return 0;
	t = bpf_map_lookup_elem(table, &i);
	if (!t || !(t->addr.w[0] | t->addr.w[1] | t->addr.w[2] | t->addr.w[3]))
		return 0;
	*be = *t;
	return 1;
}

static __always_inline __u32 pyproxy_lb6_active(const struct pyproxy_backend6 *be)
{
	struct pyproxy_backend_info *info = bpf_map_lookup_elem(&PYPROXY_MAP_BACKENDS6, be);
	__s32 n = info ? info->active : 0;

	return n > 0 ? n : 0;
}

/* lc, sed and nq over an IPv6 frontend's slots: sched.h's scan, with the comparison (pyproxy_load_better) shared. */
struct pyproxy_lb6_least {
	__u32 svc_id;
	__u32 start;
	__u32 count;
	__u32 pad;
	struct pyproxy_load load;
	struct pyproxy_backend6 best;
};

static long pyproxy_lb6_least_step(__u32 i, void *data)
{
	struct pyproxy_lb6_least *l = data;
	struct pyproxy_backend6 be;
	__u32 weight;
	int better;

	if (!l->count || !pyproxy_lb6_slot_get(l->svc_id, (l->start + i) % l->count, &be, &weight))
		return 0;
	better = pyproxy_load_better(&l->load, pyproxy_lb6_active(&be), weight);
	if (better)
		l->best = be;
	return better == 2;
}
#ifdef PYPROXY_BCC
#define PYPROXY_BCC_LOOPS_pyproxy_lb6_least_step PYPROXY_BCC_LOOPS_pyproxy_least_step
#endif

static __always_inline int pyproxy_lb6_pick_least(const struct pyproxy_svc_value *svc, struct pyproxy_backend6 *be)
{
	struct pyproxy_lb6_least l = {
		.svc_id = svc->svc_id, .start = bpf_get_prandom_u32() % svc->backend_count,
		.count = svc->backend_count, .load = { .sched = svc->sched, .num = pyproxy_no_load, .den = 1 },
	};
	__u32 n = svc->backend_count < PYPROXY_LEAST_SCAN ? svc->backend_count : PYPROXY_LEAST_SCAN;

	bpf_loop(n, pyproxy_lb6_least_step, &l, 0);
	if (l.load.num == pyproxy_no_load)
		return 0;
	*be = l.best;
	return 1;
}

/* A flow's hash for Maglev (pyproxy_flow_hash's twin): every word of both addresses counts. */
static __always_inline __u32 pyproxy_lb6_flow_hash(const struct pyproxy_pkt6 *p)
{
	__u32 h = pyproxy_mix32(p->saddr.w[0] ^ 0x9e3779b9);

	h = pyproxy_mix32(h ^ p->saddr.w[1]);
	h = pyproxy_mix32(h ^ p->saddr.w[2]);
	h = pyproxy_mix32(h ^ p->saddr.w[3]);
	h = pyproxy_mix32(h ^ pyproxy_in6_fold(&p->daddr));
	h = pyproxy_mix32(h ^ (((__u32)p->sport << 16) | p->dport));
	return pyproxy_mix32(h ^ p->proto);
}

/* The backend for a new IPv6 flow, by the frontend's scheduler (pyproxy_pick_backend's twin). */
static __always_inline int pyproxy_lb6_pick_backend(const struct pyproxy_pkt6 *p, const struct pyproxy_svc_value *svc,
						    struct pyproxy_backend6 *be)
{
	__u32 i;

	switch (pyproxy_sched_pick(svc, pyproxy_in6_fold(&p->saddr), pyproxy_in6_fold(&p->daddr),
				   svc->sched == PYPROXY_SCHED_MAGLEV ? pyproxy_lb6_flow_hash(p) : 0, &i)) {
	case PYPROXY_PICK_LEAST:
		return pyproxy_lb6_pick_least(svc, be);
	case PYPROXY_PICK_TABLE:
		if (pyproxy_lb6_table_get(svc->svc_id, i, be))
			return 1;
		i = bpf_get_prandom_u32() % svc->backend_count;
	}
	return pyproxy_lb6_slot_get(svc->svc_id, i, be, 0);
}

static __always_inline int pyproxy_lb6_ct_follow(struct pyproxy_ct6_value *ct, const struct pyproxy_svc_value *svc,
						 __u32 epoch, struct pyproxy_backend6 *be)
{
	be->addr = ct->nat_addr;
	be->port = ct->nat_port;
	be->pad = 0;
	if (ct->svc_id != svc->svc_id)
		return 0;
	if (ct->epoch == epoch)
		return 1;
	if (!pyproxy_lb6_backend_alive(be))
		return 0;
	ct->epoch = epoch;
	return 1;
}

/* Whether the IPv6 client `a` is outside the cluster CIDR's IPv6 half (pyproxy_config.cluster6; none given: no). */
static __always_inline int pyproxy_lb6_outside_cluster(const struct pyproxy_in6 *a)
{
	__u32 differ = 0;

	/* Read field by field: the constants are folded by the verifier (libbpf's .rodata) or the compiler (BCC). */
#pragma unroll
	for (int i = 0; i < 4; i++)
		differ |= (a->w[i] & pyproxy_config.cluster6.mask.w[i]) ^ pyproxy_config.cluster6.addr.w[i];
	return differ != 0;
}

/* Whether a new IPv6 flow must be SNATed, by pyproxy_lb_must_masquerade's rules. */
static __always_inline int pyproxy_lb6_must_masquerade(const struct pyproxy_pkt6 *p,
						       const struct pyproxy_svc_value *svc,
						       const struct pyproxy_backend6 *be)
{
	if ((svc->flags & PYPROXY_SVC_F_MASQ) || pyproxy_in6_eq(&be->addr, &p->saddr))
		return 1;
	return (svc->flags & PYPROXY_SVC_F_MASQ_OUTSIDE) && pyproxy_lb6_outside_cluster(&p->saddr);
}

static __always_inline int pyproxy_lb6_masquerade(void *ctx, __u32 ifindex, const struct pyproxy_pkt6 *p,
						  const struct pyproxy_svc_value *svc,
						  const struct pyproxy_backend6 *be, __u64 now)
{
	struct pyproxy_in6 addr;

	if (!pyproxy_lb6_must_masquerade(p, svc, be))
		return 0;
	if (!pyproxy_snat6_addr(ctx, ifindex, p, be, &addr)) {
		pyproxy_count(PYPROXY_CNT_SNAT_NO_ROUTE);
		return 0;
	}
	if (pyproxy_snat6_create(p, be, &addr, svc->svc_id, now)) {
		pyproxy_count(PYPROXY_CNT_SNAT_NO_PORT);
		return -1;
	}
	pyproxy_count(PYPROXY_CNT_SNAT);
	return PYPROXY_CT_F_MASQ;
}

/* pyproxy_lb_pod_view's twin, for IPv6 (--cluster-cidr's IPv6 CIDR). */
static __always_inline struct pyproxy_svc_value *pyproxy_lb6_pod_view(const struct pyproxy_pkt6 *p,
								      struct pyproxy_svc_value *svc)
{
	struct pyproxy_svc_value *node;

	if (!(svc->flags & PYPROXY_SVC_F_NODE_VIEW) || !pyproxy_config.cluster6.mask.w[0] ||
	    pyproxy_lb6_outside_cluster(&p->saddr))
		return svc;
	node = pyproxy_lb6_frontend_in(&p->daddr, p->dport, p->proto, PYPROXY_SVC_SCOPE_NODE);
	return node ? node : svc;
}

/* The forward decision for an IPv6 packet entering the node (pyproxy_lb_forward's twin). */
static __always_inline int pyproxy_lb6_forward(void *ctx, __u32 ifindex, const struct pyproxy_pkt6 *p,
					       __u64 pkt_len, int pods, struct pyproxy_backend6 *be)
{
	struct pyproxy_svc_value *svc;
	struct pyproxy_ct6_value *ct;
	struct pyproxy_ct6_key k;
	__u32 epoch;
	__u64 now;
	int masq, counted;

	svc = pyproxy_lb6_frontend_of(p);
	if (!svc) {
		if (pyproxy_snat_port(p->dport) && pyproxy_snat6_reverse(p, be))
			return PYPROXY_DNAT;
		if (p->frag != PYPROXY_FRAG_LATER)
			pyproxy_ct6_untrack(p);
		return PYPROXY_PASS;
	}
	if (pods)
		svc = pyproxy_lb6_pod_view(p, svc);
	now = pyproxy_now();
	epoch = pyproxy_backends_epoch();

	pyproxy_ct6_key_of(p, PYPROXY_CT_FORWARD, &k);
	ct = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &k);
	if (ct) {
		if (!pyproxy_ct6_live(&k, ct, now)) {
			pyproxy_count(PYPROXY_CNT_CT_EXPIRED);
		} else if (ct->flags & PYPROXY_CT_F_SNAT) {
			/* A reply to an SNAT port that is also a frontend's (lb.h). */
			if (!pyproxy_snat6_reverse(p, be))
				return PYPROXY_PASS;
			return PYPROXY_DNAT;
		} else if (pyproxy_is_syn6(p) && pyproxy_ct_reopens(ct->state)) {
			pyproxy_count(PYPROXY_CNT_CT_REOPENED);
		} else if (pyproxy_lb6_ct_follow(ct, svc, epoch, be)) {
			pyproxy_ct6_seen(&k, ct, p, now);
			pyproxy_count(PYPROXY_CNT_ESTABLISHED);
			pyproxy_count_svc(svc->svc_id, pkt_len);
			pyproxy_count_endpoint6(be, pkt_len);
			return PYPROXY_DNAT;
		} else {
			pyproxy_count(PYPROXY_CNT_REBALANCED);
		}
		if (p->frag == PYPROXY_FRAG_LATER)
			return PYPROXY_PASS;
		pyproxy_ct6_delete(&k, ct);
	} else if (p->frag == PYPROXY_FRAG_LATER) {
		return PYPROXY_PASS;
	}

	if ((svc->flags & PYPROXY_SVC_F_RANGES) && !pyproxy_lb6_source_allowed(svc, &p->saddr)) {
		pyproxy_count(PYPROXY_CNT_SOURCE_DENIED);
		return PYPROXY_DROP;
	}
	if (svc->backend_count == 0) {
		if (svc->flags & PYPROXY_SVC_F_DROP) {
			pyproxy_count(PYPROXY_CNT_NO_LOCAL);
			return PYPROXY_DROP;
		}
		pyproxy_count(PYPROXY_CNT_NO_BACKEND);
		return PYPROXY_REJECT;
	}
	if (!(pods && (svc->flags & PYPROXY_SVC_F_SOCK_PODS) && pyproxy_lb6_hairpin_claimed(p, now, &k, be)) &&
	    !((svc->flags & PYPROXY_SVC_F_AFFINITY) && pyproxy_lb6_affinity_lookup(p, svc, now, be))) {
		if (!pyproxy_lb6_pick_backend(p, svc, be)) {
			pyproxy_count(PYPROXY_CNT_SLOT_MISS);
			return PYPROXY_DROP;
		}
	}
	pyproxy_ct6_forget_snat(&p->saddr, p->sport, be, p->proto);
	masq = pyproxy_lb6_masquerade(ctx, ifindex, p, svc, be, now);
	if (masq < 0)
		return PYPROXY_DROP;
	if (svc->flags & PYPROXY_SVC_F_AFFINITY)
		pyproxy_lb6_affinity_record(p, be, svc->svc_id, now);
	counted = pyproxy_sched_counts(svc) ? PYPROXY_CT_F_COUNTED : 0;
	if (pyproxy_ct6_create(p, be, svc->svc_id, now, epoch, masq | counted))
		pyproxy_count(PYPROXY_CNT_CT_FULL);
	else if (counted)
		pyproxy_lb6_active_add(be, 1);
	pyproxy_count(PYPROXY_CNT_NEW_FLOW);
	pyproxy_count_svc(svc->svc_id, pkt_len);
	pyproxy_count_endpoint6(be, pkt_len);
	return PYPROXY_DNAT;
}

/* The reverse decision for an IPv6 packet leaving the node (pyproxy_lb_reverse's twin). */
static __always_inline int pyproxy_lb6_reverse(const struct pyproxy_pkt6 *p, struct pyproxy_backend6 *fe)
{
	if (!pyproxy_ct6_translate(p, PYPROXY_CT_REVERSE, 0, fe))
		return PYPROXY_PASS;
	pyproxy_count(PYPROXY_CNT_REVNAT);
	return PYPROXY_DNAT;
}

/* An ICMPv6 error about a translated flow: the entry of the flow the quote belongs to gives the address and port
 * the quote must carry (pyproxy_lb_icmp's twin; `dir` as there). */
static __always_inline int pyproxy_lb6_icmp(const struct pyproxy_in6 *qsaddr, const struct pyproxy_in6 *qdaddr,
					    __be16 qsport, __be16 qdport, __u8 proto, __u8 dir,
					    struct pyproxy_backend6 *to)
{
	struct pyproxy_ct6_key k;
	struct pyproxy_ct6_value *ct;

	pyproxy_ct6_key_set(&k, qdaddr, qsaddr, qdport, qsport, proto, dir);
	ct = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &k);
	if (!ct || !pyproxy_ct6_live(&k, ct, pyproxy_now()))
		return PYPROXY_PASS;
	to->addr = ct->nat_addr;
	to->port = ct->nat_port;
	to->pad = 0;
	pyproxy_count(PYPROXY_CNT_ICMP_NAT);
	return PYPROXY_DNAT;
}

/* IPv6 fragments of translated flows (frag.h's twin): the first fragment's ports, recorded under the datagram's
 * addresses and identification, for the later fragments. */
static __always_inline void pyproxy_frag6_key_of(const struct pyproxy_pkt6 *p, struct pyproxy_frag6_key *k)
{
	k->saddr = p->saddr;
	k->daddr = p->daddr;
	k->id = p->frag_id;
	k->proto = p->proto;
	k->pad[0] = 0;
	k->pad[1] = 0;
	k->pad[2] = 0;
}

static __always_inline void pyproxy_frag6_record(const struct pyproxy_pkt6 *p)
{
	struct pyproxy_frag6_key k;
	struct pyproxy_frag_value v = { .sport = p->sport, .dport = p->dport };

	if (p->frag != PYPROXY_FRAG_FIRST)
		return;
	pyproxy_frag6_key_of(p, &k);
	bpf_map_update_elem(&PYPROXY_MAP_FRAGS6, &k, &v, BPF_ANY);
}

static __always_inline int pyproxy_frag6_ports(struct pyproxy_pkt6 *p)
{
	struct pyproxy_frag6_key k;
	struct pyproxy_frag_value *v;

	pyproxy_frag6_key_of(p, &k);
	v = bpf_map_lookup_elem(&PYPROXY_MAP_FRAGS6, &k);
	if (!v)
		return 0;
	p->sport = v->sport;
	p->dport = v->dport;
	pyproxy_count(PYPROXY_CNT_FRAG_NAT);
	return 1;
}

#endif
