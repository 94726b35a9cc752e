/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * IPv4 fragments of translated flows. Only the first fragment carries the ports, so it decides (it is
 * translated like a whole datagram, and its ports are recorded under the datagram's addresses and IP id);
 * later fragments find those ports in PYPROXY_MAP_FRAGS and follow the same flow, their IPv4 header
 * rewritten alone. A later fragment that arrives before its first one finds nothing and passes untranslated
 * (the receiver then drops the datagram, as it would a datagram with a lost fragment): the node forwards
 * fragments in order, so this takes reordering before the node.
 */
#ifndef PYPROXY_FRAG_H
#define PYPROXY_FRAG_H

#include "pyproxy/counters.h"
#include "pyproxy/maps.h"
#include "pyproxy/parse.h"

static __always_inline void pyproxy_frag_key_of(const struct pyproxy_pkt *p, struct pyproxy_frag_key *k)
{
	k->saddr = p->saddr;
	k->daddr = p->daddr;
	k->id = p->ip_id;
	k->proto = p->proto;
	k->pad = 0;
}

/* A first fragment that is being translated: remember its ports for the fragments that follow. Keyed by the
 * addresses as they arrive (before translation), since later fragments arrive with those. */
static __always_inline void pyproxy_frag_record(const struct pyproxy_pkt *p)
{
	struct pyproxy_frag_key k;
	struct pyproxy_frag_value v = { .sport = p->sport, .dport = p->dport };

	if (p->frag != PYPROXY_FRAG_FIRST)
		return;
	pyproxy_frag_key_of(p, &k);
	bpf_map_update_elem(&PYPROXY_MAP_FRAGS, &k, &v, BPF_ANY);
}

/* A later fragment: fills its ports from its first fragment's record. Returns 0 when there is none (the
 * datagram is not a translated one). */
static __always_inline int pyproxy_frag_ports(struct pyproxy_pkt *p)
{
	struct pyproxy_frag_key k;
	struct pyproxy_frag_value *v;

	pyproxy_frag_key_of(p, &k);
	v = bpf_map_lookup_elem(&PYPROXY_MAP_FRAGS, &k);
	if (!v)
		return 0;
	p->sport = v->sport;
	p->dport = v->dport;
	pyproxy_count(PYPROXY_CNT_FRAG_NAT);
	return 1;
}

#endif
