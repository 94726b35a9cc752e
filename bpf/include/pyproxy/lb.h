/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Load balancing: where does a client -> frontend packet go? Shared by TC and XDP; the caller then
 * rewrites the packet with its own NAT helper. */
#ifndef PYPROXY_LB_H
#define PYPROXY_LB_H

#include "pyproxy/ct.h"
#include "pyproxy/icmp.h"
#include "pyproxy/sched.h"
#include "pyproxy/snat.h"

enum pyproxy_verdict {
	PYPROXY_PASS = 0,   /* not a frontend: leave the packet alone */
	PYPROXY_DNAT,       /* rewrite the destination to *be */
	PYPROXY_DROP,       /* a frontend that cannot be served now */
	PYPROXY_REJECT,     /* a frontend with no usable endpoint: refuse the flow (reject.h) */
};

static __always_inline int pyproxy_backend_alive(const struct pyproxy_backend *be)
{
	return bpf_map_lookup_elem(&PYPROXY_MAP_BACKENDS, be) != NULL;
}

/* Whether `be` is one of the frontend's slots: an endpoint its new flows may use (PYPROXY_MAP_AFFINITY, written for
 * frontends with ClientIP affinity only). */
static __always_inline int pyproxy_affinity_usable(__u32 svc_id, const struct pyproxy_backend *be)
{
	struct pyproxy_affinity_key k = { .svc_id = svc_id, .be = *be };

	return bpf_map_lookup_elem(&PYPROXY_MAP_AFFINITY, &k) != NULL;
}

/* ClientIP affinity: the backend this client used within the affinity window, if new flows may still use it (not
 * merely an endpoint: one that is not ready, or left this Service, is not; the caller then chooses anew and
 * records its choice). */
static __always_inline int pyproxy_affinity_lookup(const struct pyproxy_pkt *p,
						   const struct pyproxy_svc_value *svc, __u64 now,
						   struct pyproxy_backend *be)
{
	struct pyproxy_ct_key k = {
		.saddr = p->saddr, .daddr = p->daddr, .dport = p->dport,
		.proto = p->proto, .dir = PYPROXY_CT_AFFINITY,
	};
	struct pyproxy_ct_value *v = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &k);

	if (!v || now - v->last_seen > svc->affinity_ticks)
		return 0;
	be->addr = v->nat_addr;
	be->port = v->nat_port;
	be->pad = 0;
	return pyproxy_affinity_usable(svc->svc_id, be);
}

static __always_inline void pyproxy_affinity_record(const struct pyproxy_pkt *p,
						    const struct pyproxy_backend *be, __u32 svc_id, __u64 now)
{
	struct pyproxy_ct_key k = {
		.saddr = p->saddr, .daddr = p->daddr, .dport = p->dport,
		.proto = p->proto, .dir = PYPROXY_CT_AFFINITY,
	};
	struct pyproxy_ct_value v = {
		.nat_addr = be->addr, .nat_port = be->port, .svc_id = svc_id, .last_seen = now,
	};

	bpf_map_update_elem(&PYPROXY_MAP_CT, &k, &v, BPF_ANY);
}

/* Hairpin (sock.h): a pod's connect() whose chosen backend is the pod itself goes on untranslated to TC, which
 * masquerades it. The hook's choice travels with it: TC choosing again would bring a pod of n endpoints to itself
 * 1 time in n², not n. Keyed by the pod's address (the backend's, which the socket was bound to) and the frontend. */
/* Both families' claims: when the last was made (PYPROXY_MAP_HPIN). */
static __always_inline void pyproxy_hairpin_mark(__u64 now)
{
	__u32 zero = 0;

	bpf_map_update_elem(&PYPROXY_MAP_HPIN, &zero, &now, BPF_ANY);
}

/* Whether a claim may be waiting: one was made no longer ago than a claim stays fresh (pyproxy_hairpin_take). */
static __always_inline int pyproxy_hairpin_pending(__u64 now)
{
	__u32 zero = 0;
	__u64 *last = bpf_map_lookup_elem(&PYPROXY_MAP_HPIN, &zero);

	return last && now - *last <= pyproxy_config.ct.shortest;
}

static __always_inline void pyproxy_hairpin_claim(__be32 daddr, __be16 dport, __u8 proto,
						  const struct pyproxy_backend *be, __u32 svc_id, __u64 now)
{
	struct pyproxy_ct_key k = {
		.saddr = be->addr, .daddr = daddr, .dport = dport, .proto = proto, .dir = PYPROXY_CT_HAIRPIN,
	};
	struct pyproxy_ct_value v = {
		.nat_addr = be->addr, .nat_port = be->port, .svc_id = svc_id, .last_seen = now,
	};

	bpf_map_update_elem(&PYPROXY_MAP_CT, &k, &v, BPF_ANY);
	pyproxy_hairpin_mark(now);
}

/* A hairpin choice is taken once (its entry, `k` in `ct`, goes), and only fresh: a connect() sends its first packet
 * at once, so an older one is a connect() that never did. */
static __always_inline int pyproxy_hairpin_take(void *ct, const void *k, __u64 claimed, __u64 now)
{
	bpf_map_delete_elem(ct, k);
	return now - claimed <= pyproxy_config.ct.shortest;
}

/* The hook's hairpin choice for a new flow: whether there was a fresh one whose backend is still an endpoint (*be).
 * `k`: room for the key, the caller's. */
static __always_inline int pyproxy_hairpin_claimed(const struct pyproxy_pkt *p, __u64 now, struct pyproxy_ct_key *k,
						   struct pyproxy_backend *be)
{
	struct pyproxy_ct_value *v;

	if (!pyproxy_hairpin_pending(now))
		return 0;
	pyproxy_ct_key_set(k, p->saddr, p->daddr, 0, p->dport, p->proto, PYPROXY_CT_HAIRPIN);
	v = bpf_map_lookup_elem(&PYPROXY_MAP_CT, k);
	if (!v)
		return 0;
	*be = (struct pyproxy_backend){ .addr = v->nat_addr, .port = v->nat_port };
	return pyproxy_hairpin_take(&PYPROXY_MAP_CT, k, v->last_seen, now) && pyproxy_backend_alive(be);
}

/* loadBalancerSourceRanges: whether a new flow from `saddr` may use the frontend. */
static __always_inline int pyproxy_source_allowed(const struct pyproxy_svc_value *svc, __be32 saddr)
{
	struct pyproxy_srcrange_key k = { .prefixlen = 64, .svc_id = bpf_htonl(svc->svc_id), .addr = saddr };

	return bpf_map_lookup_elem(&PYPROXY_MAP_SRCRANGES, &k) != NULL;
}

/* The frontend a packet is addressed to, if it is one, in `scope` (PYPROXY_SVC_SCOPE_*): the first lookup of
 * every packet. */
static __always_inline struct pyproxy_svc_value *pyproxy_frontend_in(const struct pyproxy_pkt *p, __u8 scope)
{
	struct pyproxy_svc_key sk = { .vip = p->daddr, .port = p->dport, .proto = p->proto, .scope = scope };

	return bpf_map_lookup_elem(&PYPROXY_MAP_SERVICES, &sk);
}

static __always_inline struct pyproxy_svc_value *pyproxy_frontend_of(const struct pyproxy_pkt *p)
{
	return pyproxy_frontend_in(p, PYPROXY_SVC_SCOPE_PACKETS);
}

/* An established flow keeps its backend while the flow still belongs to this frontend and the backend is
 * still an endpoint; fills *be with it either way. The endpoint check is a lookup only when backends were
 * removed since the flow last passed it (`epoch` is the current backends epoch, read before any lookup). */
static __always_inline int pyproxy_ct_follow(struct pyproxy_ct_value *ct, const struct pyproxy_svc_value *svc,
					     __u32 epoch, struct pyproxy_backend *be)
{
	be->addr = ct->nat_addr;
	be->port = ct->nat_port;
	be->pad = 0;
	if (ct->svc_id != svc->svc_id)
		return 0;
	if (ct->epoch == epoch)
		return 1;
	if (!pyproxy_backend_alive(be))
		return 0;
	ct->epoch = epoch;
	return 1;
}

/* Whether a new flow must be SNATed (snat.h), by upstream's rules: the frontend says so (externalTrafficPolicy
 * Cluster, --masquerade-all), its client is outside the cluster CIDR and the frontend says that counts
 * (--cluster-cidr), or the backend is the client itself (hairpin: the client would drop a reply from its own
 * address). */
static __always_inline int pyproxy_lb_must_masquerade(const struct pyproxy_pkt *p,
						      const struct pyproxy_svc_value *svc,
						      const struct pyproxy_backend *be)
{
	if ((svc->flags & PYPROXY_SVC_F_MASQ) || be->addr == p->saddr)
		return 1;
	return (svc->flags & PYPROXY_SVC_F_MASQ_OUTSIDE) &&
	       (p->saddr & pyproxy_config.cluster.mask) != pyproxy_config.cluster.addr;
}

/* upstream's short circuit on the packet path: a pod (a source inside --cluster-cidr, as upstream's detect-local;
 * none without one) reaching an externalTrafficPolicy Local frontend gets the frontend as the node's processes do
 * (its PYPROXY_SVC_SCOPE_NODE entry: every endpoint, its own address kept), as if it had gone out and come back.
 * Chosen before the flow lookup: a flow's packets all meet the entry its first one did. */
static __always_inline struct pyproxy_svc_value *pyproxy_lb_pod_view(const struct pyproxy_pkt *p,
								     struct pyproxy_svc_value *svc)
{
	struct pyproxy_svc_value *node;

	if (!(svc->flags & PYPROXY_SVC_F_NODE_VIEW) || !pyproxy_config.cluster.mask ||
	    (p->saddr & pyproxy_config.cluster.mask) != pyproxy_config.cluster.addr)
		return svc;
	node = pyproxy_frontend_in(p, PYPROXY_SVC_SCOPE_NODE);
	return node ? node : svc;   /* none: mid-update, this node's endpoints serve */
}

/* SNAT for a new flow that needs it: records the SNAT pair and returns the Service flow's FORWARD entry flags,
 * or -1: no free port. */
static __always_inline int pyproxy_lb_masquerade(void *ctx, __u32 ifindex, const struct pyproxy_pkt *p,
						 const struct pyproxy_svc_value *svc,
						 const struct pyproxy_backend *be, __u64 now)
{
	__be32 addr;

	if (!pyproxy_lb_must_masquerade(p, svc, be))
		return 0;
	addr = pyproxy_snat_addr(ctx, ifindex, p, be);
	if (!addr) {
		pyproxy_count(PYPROXY_CNT_SNAT_NO_ROUTE);
		return 0;
	}
	if (pyproxy_snat_create(p, be, addr, svc->svc_id, now)) {
		pyproxy_count(PYPROXY_CNT_SNAT_NO_PORT);
		return -1;
	}
	pyproxy_count(PYPROXY_CNT_SNAT);
	return PYPROXY_CT_F_MASQ;
}

/* The forward decision for a packet entering the node on device `ifindex` (`ctx`: the program's context, for
 * the routing lookup SNAT makes). Cost for packets that are not ours: one hash lookup (plus
 * pyproxy_ct_untrack's array read for a SYN or a UDP datagram, and a flow lookup for one to an SNAT port). For an
 * established flow: two (frontend, flow) and an array read (the epoch); a third (backend still an endpoint)
 * once per flow after backends were removed, and one on each state change (pyproxy_ct_seen). A later fragment
 * (p->frag) only follows its flow: it never starts one. A backend's reply to an SNATed flow comes back as
 * PYPROXY_DNAT too, with *be its client. `pods`: whether this node's pods' packets may come here (TC, on their
 * veths; not XDP on the uplinks), which may follow a socket hook's hairpin choice and take upstream's short
 * circuit (pyproxy_lb_pod_view; a constant: XDP, near the verifier's limits under BCC, has none of that code). */
static __always_inline int pyproxy_lb_forward(void *ctx, __u32 ifindex, const struct pyproxy_pkt *p, __u64 pkt_len,
					      int pods, struct pyproxy_backend *be)
{
	struct pyproxy_svc_value *svc;
	struct pyproxy_ct_value *ct;
	struct pyproxy_ct_key k;
	__u32 epoch;
	__u64 now;
	int masq, counted;

	svc = pyproxy_frontend_of(p);
	if (!svc) {
		if (pyproxy_snat_port(p->dport) && pyproxy_snat_reverse(p, be))
			return PYPROXY_DNAT;
		if (p->frag != PYPROXY_FRAG_LATER)
			pyproxy_ct_untrack(p);
		return PYPROXY_PASS;
	}
	if (pods)
		svc = pyproxy_lb_pod_view(p, svc);
	now = pyproxy_now();
	/* Before the backend is looked up or chosen: an epoch read after a concurrent removal could otherwise
	 * vouch for the removed backend. */
	epoch = pyproxy_backends_epoch();

	pyproxy_ct_key_of(p, PYPROXY_CT_FORWARD, &k);
	ct = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &k);
	if (ct) {
		if (!pyproxy_ct_live(&k, ct, now)) {
			pyproxy_count(PYPROXY_CNT_CT_EXPIRED);
		} else if (ct->flags & PYPROXY_CT_F_SNAT) {
			/* A backend's reply to an SNAT port that is also a frontend's (a Service on a node address): the
			 * live SNAT pair under this very key says whose it is. */
			if (!pyproxy_snat_reverse(p, be))
				return PYPROXY_PASS;
			return PYPROXY_DNAT;
		} else if (pyproxy_is_syn(p) && pyproxy_ct_reopens(ct->state)) {
			/* A SYN on a closing or closed flow: the client opened a new connection on the same ports. */
			pyproxy_count(PYPROXY_CNT_CT_REOPENED);
		} else if (pyproxy_ct_follow(ct, svc, epoch, be)) {
			pyproxy_ct_seen(&k, ct, p, now);
			pyproxy_count(PYPROXY_CNT_ESTABLISHED);
			pyproxy_count_svc(svc->svc_id, pkt_len);
			pyproxy_count_endpoint(be, pkt_len);
			return PYPROXY_DNAT;
		} else {
			pyproxy_count(PYPROXY_CNT_REBALANCED);
		}
		if (p->frag == PYPROXY_FRAG_LATER)
			return PYPROXY_PASS;
		/* The old flow goes whole: its reverse entry would otherwise outlive it if the new flow gets
		 * another backend. */
		pyproxy_ct_delete(&k, ct);
	} else if (p->frag == PYPROXY_FRAG_LATER) {
		return PYPROXY_PASS;
	}

	if ((svc->flags & PYPROXY_SVC_F_RANGES) && !pyproxy_source_allowed(svc, p->saddr)) {
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
	if (!(pods && (svc->flags & PYPROXY_SVC_F_SOCK_PODS) && pyproxy_hairpin_claimed(p, now, &k, be)) &&
	    !((svc->flags & PYPROXY_SVC_F_AFFINITY) && pyproxy_affinity_lookup(p, svc, now, be))) {
		if (!pyproxy_pick_backend(p, svc, be)) {
			pyproxy_count(PYPROXY_CNT_SLOT_MISS);
			return PYPROXY_DROP;
		}
	}
	/* An SNAT pair an earlier flow from the client's port to this backend left would take this flow's packets
	 * (a new flow's only extra lookup; the new flow's own pair, if it needs one, comes next). */
	pyproxy_ct_forget_snat(p->saddr, p->sport, be, p->proto);
	masq = pyproxy_lb_masquerade(ctx, ifindex, p, svc, be, now);
	if (masq < 0)
		return PYPROXY_DROP;
	if (svc->flags & PYPROXY_SVC_F_AFFINITY)
		pyproxy_affinity_record(p, be, svc->svc_id, now);
	counted = pyproxy_sched_counts(svc) ? PYPROXY_CT_F_COUNTED : 0;
	if (pyproxy_ct_create(p, be, svc->svc_id, now, epoch, masq | counted))
		pyproxy_count(PYPROXY_CNT_CT_FULL);
	else if (counted)
		pyproxy_active_add(be, 1);
	pyproxy_count(PYPROXY_CNT_NEW_FLOW);
	pyproxy_count_svc(svc->svc_id, pkt_len);
	pyproxy_count_endpoint(be, pkt_len);
	return PYPROXY_DNAT;
}

/* The reverse decision for a packet leaving the node: a backend's reply gets its frontend back, while its
 * flow is live (and an SNATed flow's packet toward its backend gets its node address and port: snat.h). */
static __always_inline int pyproxy_lb_reverse(const struct pyproxy_pkt *p, struct pyproxy_backend *fe)
{
	if (!pyproxy_ct_translate(p, PYPROXY_CT_REVERSE, 0, fe))
		return PYPROXY_PASS;
	pyproxy_count(PYPROXY_CNT_REVNAT);
	return PYPROXY_DNAT;
}

/* An ICMP error about a translated flow: the entry of the flow the quoted packet belongs to gives the address
 * the quote must carry. `dir` is the entry to look in: PYPROXY_CT_REVERSE for an error leaving toward a client
 * (the quote reads client -> backend, the reply tuple of the entry backend -> client; fills the frontend),
 * PYPROXY_CT_FORWARD for one entering toward a frontend (the quote reads frontend -> client; fills the
 * backend). */
static __always_inline int pyproxy_lb_icmp(const struct pyproxy_icmp_err *e, __u8 dir, struct pyproxy_backend *to)
{
	struct pyproxy_ct_key k = {
		.saddr = e->daddr, .daddr = e->saddr, .sport = e->dport, .dport = e->sport,
		.proto = e->proto, .dir = dir,
	};
	struct pyproxy_ct_value *ct = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &k);

	if (!ct || !pyproxy_ct_live(&k, ct, pyproxy_now()))
		return PYPROXY_PASS;
	to->addr = ct->nat_addr;
	to->port = ct->nat_port;
	to->pad = 0;
	pyproxy_count(PYPROXY_CNT_ICMP_NAT);
	return PYPROXY_DNAT;
}

#endif
