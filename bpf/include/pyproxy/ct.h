/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Connection tracking: keys built from a parsed packet, entries recorded for a new flow. */
#ifndef PYPROXY_CT_H
#define PYPROXY_CT_H

#include "pyproxy/maps.h"
#include "pyproxy/parse.h"

static __always_inline void pyproxy_ct_key_of(const struct pyproxy_pkt *p, __u8 dir, struct pyproxy_ct_key *k)
{
	k->saddr = p->saddr;
	k->daddr = p->daddr;
	k->sport = p->sport;
	k->dport = p->dport;
	k->proto = p->proto;
	k->dir = dir;
	k->pad = 0;
}

/* The clock of last_seen and of ClientIP affinity, in ticks (jiffies; HZ per second, which the control plane
 * finds out and converts with). The verifier inlines bpf_jiffies64() into one load; measured here
 * (bench/steps.bpf.c), bpf_ktime_get_coarse_ns() cost 17-22 ns a packet and bpf_ktime_get_ns() 30 ns, a
 * sixth and a quarter of an established flow, for a resolution that idle ages and affinity timeouts in
 * seconds do not need. (Cilium keeps its conntrack clock in jiffies for the same reason.) */
static __always_inline __u64 pyproxy_now(void)
{
	return bpf_jiffies64();
}

static __always_inline __u32 pyproxy_backends_epoch(void)
{
	__u32 zero = 0;
	__u32 *epoch = bpf_map_lookup_elem(&PYPROXY_MAP_EPOCH, &zero);

	return epoch ? *epoch : 0;
}

static __always_inline struct pyproxy_ct_value *pyproxy_ct_lookup(const struct pyproxy_pkt *p, __u8 dir)
{
	struct pyproxy_ct_key k;

	pyproxy_ct_key_of(p, dir, &k);
	return bpf_map_lookup_elem(&PYPROXY_MAP_CT, &k);
}

/* Records both directions of a new flow: the forward entry for the client's later packets and the
 * reverse entry, keyed as the backend's replies will look, for reverse NAT. Returns non-zero when the
 * table refused (only possible under memory pressure: the LRU evicts rather than fills). */
static __always_inline int pyproxy_ct_create(const struct pyproxy_pkt *p, const struct pyproxy_backend *be,
					     __u32 svc_id, __u64 now, __u32 epoch)
{
	struct pyproxy_ct_key fwd, rev;
	struct pyproxy_ct_value fv = {}, rv = {};

	pyproxy_ct_key_of(p, PYPROXY_CT_FORWARD, &fwd);
	fv.nat_addr = be->addr;
	fv.nat_port = be->port;
	fv.svc_id = svc_id;
	fv.epoch = epoch;
	fv.last_seen = now;

	rev.saddr = be->addr;
	rev.daddr = p->saddr;
	rev.sport = be->port;
	rev.dport = p->sport;
	rev.proto = p->proto;
	rev.dir = PYPROXY_CT_REVERSE;
	rev.pad = 0;
	rv.nat_addr = p->daddr;
	rv.nat_port = p->dport;
	rv.svc_id = svc_id;
	rv.last_seen = now;

	/* Reverse first: a forward entry without its reverse would send replies out untranslated. */
	if (bpf_map_update_elem(&PYPROXY_MAP_CT, &rev, &rv, BPF_ANY))
		return -1;
	return bpf_map_update_elem(&PYPROXY_MAP_CT, &fwd, &fv, BPF_ANY);
}

#endif
