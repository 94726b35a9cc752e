/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Connection tracking of IPv6 flows (PYPROXY_MAP_CT6): ct.h's twin, entry for entry and rule for rule. The
 * address-independent parts are ct.h's own: the clock, the timeouts by state, the state machine
 * (pyproxy_ct_next), the endpoint-port bitmap. So an IPv6 flow has the same FORWARD/REVERSE pair, the same states
 * and timeouts, and the same closed-connection rules: a SYN on a closing or closed flow starts a new flow, and a
 * SYN or datagram that is no Service's removes the flow whose reverse entry would rewrite its replies
 * (pyproxy_ct6_untrack).
 */
#ifndef PYPROXY_CT6_H
#define PYPROXY_CT6_H

#include "pyproxy/ct.h"
#include "pyproxy/parse6.h"

static __always_inline void pyproxy_ct6_key_set(struct pyproxy_ct6_key *k, const struct pyproxy_in6 *saddr,
						const struct pyproxy_in6 *daddr, __be16 sport, __be16 dport, __u8 proto,
						__u8 dir)
{
	k->saddr = *saddr;
	k->daddr = *daddr;
	k->sport = sport;
	k->dport = dport;
	k->proto = proto;
	k->dir = dir;
	k->pad = 0;
}

static __always_inline void pyproxy_ct6_key_of(const struct pyproxy_pkt6 *p, __u8 dir, struct pyproxy_ct6_key *k)
{
	pyproxy_ct6_key_set(k, &p->saddr, &p->daddr, p->sport, p->dport, p->proto, dir);
}

static __always_inline int pyproxy_ct6_expired(const struct pyproxy_ct6_value *v, __u8 proto, __u64 now)
{
	return pyproxy_ct_idle_expired(v->last_seen, v->state, proto, now);
}

/* The key of the other direction's entry of the flow `v` under `k` belongs to (pyproxy_ct_peer_key's twin). */
static __always_inline void pyproxy_ct6_peer_key(const struct pyproxy_ct6_key *k, const struct pyproxy_ct6_value *v,
						 struct pyproxy_ct6_key *peer)
{
	if (k->dir == PYPROXY_CT_FORWARD)
		pyproxy_ct6_key_set(peer, &v->nat_addr, &k->saddr, v->nat_port, k->sport, k->proto, PYPROXY_CT_REVERSE);
	else
		pyproxy_ct6_key_set(peer, &k->daddr, &v->nat_addr, k->dport, v->nat_port, k->proto, PYPROXY_CT_FORWARD);
}

/* Whether `peer`, found under the peer key of an entry under `k`, is the other half of the same flow: it points back
 * at `k`'s frontend or client (an entry under that key may belong to another flow that reached the same backend). */
static __always_inline int pyproxy_ct6_is_peer(const struct pyproxy_ct6_key *k, const struct pyproxy_ct6_value *peer)
{
	return k->dir == PYPROXY_CT_FORWARD ? pyproxy_in6_eq(&peer->nat_addr, &k->daddr) && peer->nat_port == k->dport
					    : pyproxy_in6_eq(&peer->nat_addr, &k->saddr) && peer->nat_port == k->sport;
}

/* The peer entry of `v`, if it is the other half of the same flow. */
static __always_inline struct pyproxy_ct6_value *pyproxy_ct6_peer(const struct pyproxy_ct6_key *k,
								  const struct pyproxy_ct6_value *v)
{
	struct pyproxy_ct6_key pk;
	struct pyproxy_ct6_value *peer;

	pyproxy_ct6_peer_key(k, v, &pk);
	peer = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &pk);
	return peer && pyproxy_ct6_is_peer(k, peer) ? peer : NULL;
}

static __always_inline int pyproxy_ct6_live(const struct pyproxy_ct6_key *k, const struct pyproxy_ct6_value *v,
					    __u64 now)
{
	struct pyproxy_ct6_value *peer;

	if (!pyproxy_ct6_expired(v, k->proto, now))
		return 1;
	peer = pyproxy_ct6_peer(k, v);
	return peer && !pyproxy_ct6_expired(peer, k->proto, now);
}

static __always_inline __u8 pyproxy_ct6_orig_dir(const struct pyproxy_ct6_key *k, const struct pyproxy_ct6_value *v)
{
	return v->flags & PYPROXY_CT_F_SNAT ? k->dir ^ 1 : k->dir;
}

/* The backend of the Service flow an entry belongs to (pyproxy_ct_backend's twin). */
static __always_inline void pyproxy_ct6_backend(const struct pyproxy_ct6_key *k, const struct pyproxy_ct6_value *v,
						struct pyproxy_backend6 *be)
{
	be->addr = k->dir == PYPROXY_CT_FORWARD ? v->nat_addr : k->saddr;
	be->port = k->dir == PYPROXY_CT_FORWARD ? v->nat_port : k->sport;
	be->pad = 0;
}

/* One more or one fewer open flow to an IPv6 backend (lc, sed, nq). */
static __always_inline void pyproxy_lb6_active_add(const struct pyproxy_backend6 *be, int delta)
{
	struct pyproxy_backend_info *info = bpf_map_lookup_elem(&PYPROXY_MAP_BACKENDS6, be);

	if (info)
		__sync_fetch_and_add(&info->active, delta);
}

static __always_inline void pyproxy_ct6_uncount(const struct pyproxy_ct6_key *k, const struct pyproxy_ct6_value *v)
{
	struct pyproxy_backend6 be;

	if ((v->flags & (PYPROXY_CT_F_COUNTED | PYPROXY_CT_F_SNAT)) != PYPROXY_CT_F_COUNTED || pyproxy_ct_over(v->state))
		return;
	pyproxy_ct6_backend(k, v, &be);
	pyproxy_lb6_active_add(&be, -1);
}

/* A packet of a live flow passed in the direction of entry `v` (pyproxy_ct_seen's twin). */
static __always_inline void pyproxy_ct6_seen(const struct pyproxy_ct6_key *k, struct pyproxy_ct6_value *v,
					     const struct pyproxy_pkt6 *p, __u64 now)
{
	__u8 state, flags;
	struct pyproxy_ct6_value *peer = NULL;

	if (!pyproxy_ct_advance(&v->last_seen, &v->seq_end, v->state, v->flags, pyproxy_ct6_orig_dir(k, v), p->tcp_flags,
				pyproxy_pkt_seq(&p->tcp_seq), pyproxy_pkt_end(&p->tcp_seq, p->l4_len, &p->tcp_hlen, p->tcp_flags), now, &state,
				&flags)) {
		if (v->state != PYPROXY_CT_ST_SYN_RECV || k->proto != IPPROTO_UDP)
			return;
		if (!pyproxy_ct_holds_born(k->dir, v->flags)) {
			peer = pyproxy_ct6_peer(k, v);
			if (!peer || !pyproxy_ct_stream_due(peer->epoch, now))
				return;
		} else if (!pyproxy_ct_stream_due(v->epoch, now)) {
			return;
		}
		state = PYPROXY_CT_ST_ESTABLISHED;
		flags = v->flags;
	}
	if (pyproxy_ct_over(state))
		pyproxy_ct6_uncount(k, v);
	v->state = state;
	v->flags = flags;
	if (!peer)
		peer = pyproxy_ct6_peer(k, v);
	if (peer) {
		peer->state = state;
		peer->flags = (peer->flags & ~PYPROXY_CT_F_FLOW) | (flags & PYPROXY_CT_F_FLOW);
	}
}

/* The translation of a packet following a live flow's entry in direction `dir` (pyproxy_ct_translate's twin). */
static __always_inline int pyproxy_ct6_translate(const struct pyproxy_pkt6 *p, __u8 dir, __u8 flags,
						 struct pyproxy_backend6 *to)
{
	struct pyproxy_ct6_value *ct;
	struct pyproxy_ct6_key k;
	__u64 now;

	pyproxy_ct6_key_of(p, dir, &k);
	ct = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &k);
	if (!ct || (ct->flags & flags) != flags)
		return 0;
	now = pyproxy_now();
	if (!pyproxy_ct6_live(&k, ct, now)) {
		pyproxy_count(PYPROXY_CNT_CT_EXPIRED);
		return 0;
	}
	to->addr = ct->nat_addr;
	to->port = ct->nat_port;
	to->pad = 0;
	pyproxy_ct6_seen(&k, ct, p, now);
	return 1;
}

static __always_inline void pyproxy_ct6_delete_pair(const struct pyproxy_ct6_key *k,
						    const struct pyproxy_ct6_value *v)
{
	struct pyproxy_ct6_key pk;
	struct pyproxy_ct6_value *peer;

	/* One key for the lookup and the delete (stack: see pyproxy_ct6_create). */
	pyproxy_ct6_peer_key(k, v, &pk);
	peer = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &pk);
	if (peer && pyproxy_ct6_is_peer(k, peer))
		bpf_map_delete_elem(&PYPROXY_MAP_CT6, &pk);
	bpf_map_delete_elem(&PYPROXY_MAP_CT6, k);
}

/* Removes the SNAT pair whose REVERSE entry would rewrite client:cport -> be (pyproxy_ct_forget_snat's twin). */
static __always_inline int pyproxy_ct6_forget_snat(const struct pyproxy_in6 *client, __be16 cport,
						   const struct pyproxy_backend6 *be, __u8 proto)
{
	struct pyproxy_ct6_key sk;
	struct pyproxy_ct6_value *sv;

	pyproxy_ct6_key_set(&sk, client, &be->addr, cport, be->port, proto, PYPROXY_CT_REVERSE);
	sv = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &sk);
	if (!sv || !(sv->flags & PYPROXY_CT_F_SNAT))
		return 0;
	pyproxy_ct6_delete_pair(&sk, sv);
	return 1;
}

/* Removes a flow, with its SNAT pair (pyproxy_ct_delete's twin). */
static __always_inline void pyproxy_ct6_delete(const struct pyproxy_ct6_key *k, const struct pyproxy_ct6_value *v)
{
	struct pyproxy_ct6_key sk;
	struct pyproxy_ct6_value *sv;

	pyproxy_ct6_uncount(k, v);
	if (k->dir == PYPROXY_CT_FORWARD && (v->flags & PYPROXY_CT_F_MASQ)) {
		pyproxy_ct6_key_set(&sk, &k->saddr, &v->nat_addr, k->sport, v->nat_port, k->proto, PYPROXY_CT_REVERSE);
		sv = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &sk);
		if (sv && (sv->flags & PYPROXY_CT_F_SNAT))
			pyproxy_ct6_delete_pair(&sk, sv);
	}
	pyproxy_ct6_delete_pair(k, v);
}

/* Records both directions of a new flow (pyproxy_ct_create's twin): reverse first. One key and one value serve
 * both entries, written in turn: IPv6 entries are twice IPv4's size, and the program's stack and a bpf_loop
 * callback's must fit in 512 bytes together. */
static __always_inline int pyproxy_ct6_create(const struct pyproxy_pkt6 *p, const struct pyproxy_backend6 *be,
					      __u32 svc_id, __u64 now, __u32 epoch, __u8 fwd_flags)
{
	struct pyproxy_ct6_key k;
	struct pyproxy_ct6_value v = {};
	__u8 state = PYPROXY_CT_ST_NEW, flags = 0;

	pyproxy_ct_next(PYPROXY_CT_FORWARD, p->tcp_flags, &state, &flags);
	pyproxy_ct6_key_set(&k, &be->addr, &p->saddr, be->port, p->sport, p->proto, PYPROXY_CT_REVERSE);
	v.nat_addr = p->daddr;
	v.nat_port = p->dport;
	v.state = state;
	v.flags = flags | (fwd_flags & PYPROXY_CT_F_COUNTED);
	v.svc_id = svc_id;
	v.epoch = (__u32)now;   /* the flow's beginning (abi.h) */
	v.last_seen = now;
	if (bpf_map_update_elem(&PYPROXY_MAP_CT6, &k, &v, BPF_ANY))
		return -1;
	/* The client's SYN (ct.h, the RST window); the reverse entry learns its own. */
	v.seq_end = pyproxy_pkt_end(&p->tcp_seq, p->l4_len, &p->tcp_hlen, p->tcp_flags);

	pyproxy_ct6_key_of(p, PYPROXY_CT_FORWARD, &k);
	v.nat_addr = be->addr;
	v.nat_port = be->port;
	v.flags = flags | fwd_flags;
	v.epoch = epoch;
	return bpf_map_update_elem(&PYPROXY_MAP_CT6, &k, &v, BPF_ANY);
}

/* A packet that is no Service's, entering the node (pyproxy_ct_untrack's twin): a SYN or datagram to an endpoint
 * port whose reply tuple is an old Service flow's reverse entry removes that flow, so the direct connection's
 * replies are not rewritten to come from the frontend. */
static __always_inline void pyproxy_ct6_untrack(const struct pyproxy_pkt6 *p)
{
	struct pyproxy_backend6 to = { .addr = p->daddr, .port = p->dport };
	struct pyproxy_ct6_key k;
	struct pyproxy_ct6_value *v;
	int gone;

	if (p->proto == IPPROTO_TCP ? !pyproxy_is_syn6(p) : p->proto != IPPROTO_UDP)
		return;
	if (!pyproxy_endpoint_port(p->dport))
		return;
	pyproxy_ct6_key_set(&k, &p->daddr, &p->saddr, p->dport, p->sport, p->proto, PYPROXY_CT_REVERSE);
	v = bpf_map_lookup_elem(&PYPROXY_MAP_CT6, &k);
	gone = v && !(v->flags & PYPROXY_CT_F_SNAT);
	if (gone)
		pyproxy_ct6_delete(&k, v);
	gone |= pyproxy_ct6_forget_snat(&p->saddr, p->sport, &to, p->proto);
	if (gone)
		pyproxy_count(PYPROXY_CNT_CT_UNTRACKED);
}

#endif
