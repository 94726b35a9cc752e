/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * ICMPv6 errors about translated IPv6 flows (destination unreachable, packet too big, time exceeded, parameter
 * problem): icmp.h's twin. IPv6 routers never fragment, so path-MTU discovery through a ClusterIP depends on the
 * client's stack matching "packet too big" to its socket by the quote: the quote must read as the client's own
 * packet (client -> frontend), and an error about a reply must reach the backend with the quote it sent.
 *
 * TC only. The error and its quote must carry no extension headers (anything else passes as it is). The ICMPv6
 * checksum covers the outer addresses through its pseudo header, the quote, and within the quote the quoted
 * TCP/UDP checksum, whose own pseudo header covers the quoted addresses: every change is folded in incrementally,
 * and each changed region's sum stays invariant, so a CHECKSUM_COMPLETE skb's sum stays right too.
 */
#ifndef PYPROXY_ICMP6_H
#define PYPROXY_ICMP6_H

#include "pyproxy/csum.h"
#include "pyproxy/icmp.h"
#include "pyproxy/nat.h"
#include "pyproxy/parse6.h"

/* RFC 4443 error types (and the code reject6.h answers with). */
#define PYPROXY_ICMP6_DEST_UNREACH 1
#define PYPROXY_ICMP6_PORT_UNREACH 4   /* code of PYPROXY_ICMP6_DEST_UNREACH */
#define PYPROXY_ICMP6_PKT_TOOBIG   2
#define PYPROXY_ICMP6_TIME_EXCEED  3
#define PYPROXY_ICMP6_PARAMPROB    4

/* What pyproxy_icmp6_parse finds: offsets from the frame's start and the quoted packet's tuple. */
struct pyproxy_icmp6_err {
	__u32 in_l4;       /* the quoted TCP/UDP header */
	__u32 end;         /* one past the ICMPv6 message */
	struct pyproxy_in6 saddr;
	struct pyproxy_in6 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
};

#define PYPROXY_ICMP6_OFF  (sizeof(struct ethhdr) + sizeof(struct ipv6hdr))   /* the ICMPv6 header */
#define PYPROXY_ICMP6_IN_L3 (PYPROXY_ICMP6_OFF + sizeof(struct pyproxy_icmphdr))  /* the quoted IPv6 header */
#define PYPROXY_ICMP6_IN_L4 (PYPROXY_ICMP6_IN_L3 + sizeof(struct ipv6hdr))   /* the quoted TCP/UDP header */
/* How much TC pulls into the linear area: up to the quoted TCP checksum. */
#define PYPROXY_ICMP6_PULL (PYPROXY_ICMP6_IN_L4 + 18)

static __always_inline int pyproxy_icmp6_parse(void *data, void *data_end, const struct pyproxy_pkt6 *p,
					       struct pyproxy_icmp6_err *e)
{
	struct pyproxy_icmphdr *ic = data + PYPROXY_ICMP6_OFF;
	struct ipv6hdr *in = data + PYPROXY_ICMP6_IN_L3;
	__be16 *ports = data + PYPROXY_ICMP6_IN_L4;

	if (p->l4_off != PYPROXY_ICMP6_OFF || (void *)(ports + 2) > data_end)
		return 0;
	if (ic->type != PYPROXY_ICMP6_DEST_UNREACH && ic->type != PYPROXY_ICMP6_PKT_TOOBIG &&
	    ic->type != PYPROXY_ICMP6_TIME_EXCEED && ic->type != PYPROXY_ICMP6_PARAMPROB)
		return 0;
	if (in->version != 6 || (in->nexthdr != IPPROTO_TCP && in->nexthdr != IPPROTO_UDP))
		return 0;
	__builtin_memcpy(&e->saddr, &in->saddr, sizeof(e->saddr));
	__builtin_memcpy(&e->daddr, &in->daddr, sizeof(e->daddr));
	e->sport = ports[0];
	e->dport = ports[1];
	e->proto = in->nexthdr;
	e->in_l4 = PYPROXY_ICMP6_IN_L4;
	e->end = p->l4_off + p->l4_len;
	return 1;
}

/* Rewrites the quote's `side` address and port to `to` (icmp.h's pyproxy_icmp_nat, for IPv6), and the outer
 * header's opposite address when it is the old one. */
static __always_inline int pyproxy_icmp6_nat(void *data, void *data_end, const struct pyproxy_icmp6_err *e, int side,
					     const struct pyproxy_backend6 *to)
{
	struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);
	struct pyproxy_icmphdr *ic = data + PYPROXY_ICMP6_OFF;
	struct ipv6hdr *in = data + PYPROXY_ICMP6_IN_L3;
	__be16 *in_port = data + PYPROXY_ICMP6_IN_L4 + (side == PYPROXY_NAT_DST ? 2 : 0);
	__u32 csum_at = PYPROXY_ICMP6_IN_L4 + (e->proto == IPPROTO_TCP ? __builtin_offsetof(struct tcphdr, check)
								       : __builtin_offsetof(struct udphdr, check));
	__u16 *in_csum = data + csum_at;
	struct pyproxy_in6 *quoted, *outer;
	__be16 old_port;
	__u16 prev, c;
	int outer_too;

	if ((void *)(in_port + 1) > data_end)
		return -1;
	quoted = (void *)(side == PYPROXY_NAT_DST ? &in->daddr : &in->saddr);
	outer = (void *)(side == PYPROXY_NAT_DST ? &ip6->saddr : &ip6->daddr);
	/* Every sum is updated from the quoted address before it is overwritten. */
	outer_too = pyproxy_in6_eq(outer, quoted);
	old_port = *in_port;
	/* The quoted L4 checksum, when the quote holds it, covers the quoted address and port. */
	if (csum_at + 2 <= e->end && (void *)(in_csum + 1) <= data_end &&
	    !(e->proto == IPPROTO_UDP && *in_csum == 0)) {
		prev = *in_csum;
		c = prev;
#pragma unroll
		for (int i = 0; i < 4; i++)
			c = pyproxy_csum_replace(c, quoted->w[i], to->addr.w[i]);
		c = pyproxy_csum_replace(c, old_port, to->port);
		if (e->proto == IPPROTO_UDP && c == 0)
			c = 0xffff;
		*in_csum = c;
		ic->checksum = pyproxy_csum_replace(ic->checksum, prev, c);
	}
	*in_port = to->port;
	c = pyproxy_csum_replace(ic->checksum, old_port, to->port);
#pragma unroll
	for (int i = 0; i < 4; i++) {
		c = pyproxy_csum_replace(c, quoted->w[i], to->addr.w[i]);
		/* The outer address is in the ICMPv6 pseudo header: its change is folded in as well. */
		if (outer_too)
			c = pyproxy_csum_replace(c, quoted->w[i], to->addr.w[i]);
	}
	ic->checksum = c;
	*quoted = to->addr;
	if (outer_too)
		*outer = to->addr;
	return 0;
}

#endif
