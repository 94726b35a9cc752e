/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * IPv6 packet parsing, shared by TC and XDP: parse.h's twin. Extension headers between the IPv6 header and the
 * upper-layer header (hop-by-hop options, routing, destination options, fragment) are skipped in a bounded loop;
 * any other next header (AH, ESP, no next header, an unknown one) or more extension headers than the loop takes
 * leave the packet to the stack. A fragment header whose offset is 0 is the first fragment, which carries the
 * ports; a later one gets them from its datagram's record, as IPv4 fragments do (frag.h, PYPROXY_MAP_FRAGS6).
 * A header that claims more than the packet or the payload length holds is SKIP (or SHORT where TC may pull more
 * of the packet in): never parsed past what is there.
 */
#ifndef PYPROXY_PARSE6_H
#define PYPROXY_PARSE6_H

#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ipv6.h>
#include "pyproxy/abi.h"
#include "pyproxy/parse.h"

#ifndef IPPROTO_HOPOPTS
#define IPPROTO_HOPOPTS 0
#endif
#ifndef IPPROTO_ROUTING
#define IPPROTO_ROUTING 43
#endif
#ifndef IPPROTO_FRAGMENT
#define IPPROTO_FRAGMENT 44
#endif
#ifndef IPPROTO_ICMPV6
#define IPPROTO_ICMPV6 58
#endif
#ifndef IPPROTO_DSTOPTS
#define IPPROTO_DSTOPTS 60
#endif

/* How many extension headers the parser walks: RFC 8200's recommended order has at most hop-by-hop, destination
 * options, routing, fragment and destination options again before the upper layer. */
#define PYPROXY_IPV6_EXT_MAX 5
#define PYPROXY_IPV6_FRAG_OFFSET 0xfff8   /* the fragment header's offset bits (network order after ntohs) */
#define PYPROXY_IPV6_FRAG_MF     0x0001

/* What NAT needs to know about an IPv6 packet (struct pyproxy_pkt's twin). */
struct pyproxy_pkt6 {
	struct pyproxy_in6 saddr;
	struct pyproxy_in6 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;        /* the upper-layer protocol */
	__u8 tcp_flags;    /* PYPROXY_TCP_*; 0 for UDP */
	__u8 frag;         /* enum pyproxy_frag */
	__u8 tcp_hlen;     /* as struct pyproxy_pkt's (took the place of a pad: the IPv6 programs' stack is full) */
	__be32 frag_id;    /* the fragment header's identification, for fragments */
	__u32 l3_off;      /* offset of the IPv6 header */
	__u32 l4_off;      /* offset of the upper-layer header (after every extension header) */
	__u32 l4_len;      /* upper-layer header + payload, from the payload length */
	__u32 csum_off;    /* offset of the TCP/UDP checksum field */
	__u32 tcp_seq;     /* host order; as struct pyproxy_pkt's */
};

static __always_inline int pyproxy_is_syn6(const struct pyproxy_pkt6 *p)
{
	return (p->tcp_flags & (PYPROXY_TCP_SYN | PYPROXY_TCP_ACK)) == PYPROXY_TCP_SYN;
}

static __always_inline int pyproxy_in6_eq(const struct pyproxy_in6 *a, const struct pyproxy_in6 *b)
{
	return ((a->w[0] ^ b->w[0]) | (a->w[1] ^ b->w[1]) | (a->w[2] ^ b->w[2]) | (a->w[3] ^ b->w[3])) == 0;
}

/* An address folded to 32 bits, for the schedulers' hashes (sh, dh, Maglev). */
static __always_inline __u32 pyproxy_in6_fold(const struct pyproxy_in6 *a)
{
	return a->w[0] ^ a->w[1] ^ a->w[2] ^ a->w[3];
}

/* The IPv6 extension headers the parser skips. */
static __always_inline int pyproxy_ipv6_ext(__u8 nexthdr)
{
	return nexthdr == IPPROTO_HOPOPTS || nexthdr == IPPROTO_ROUTING || nexthdr == IPPROTO_DSTOPTS ||
	       nexthdr == IPPROTO_FRAGMENT;
}

/* Fills *p for an IPv6 TCP or UDP packet; results as pyproxy_parse's (ICMP: an ICMPv6 message). */
static __always_inline int pyproxy_parse6(void *data, void *data_end, struct pyproxy_pkt6 *p)
{
	struct ethhdr *eth = data;
	struct ipv6hdr *ip6;
	__u32 off, end;
	__u8 nexthdr;

	if ((void *)(eth + 1) > data_end)
		return PYPROXY_PARSE_SHORT;
	if (eth->h_proto != bpf_htons(ETH_P_IPV6))
		return PYPROXY_PARSE_SKIP;
	ip6 = (void *)(eth + 1);
	if ((void *)(ip6 + 1) > data_end)
		return PYPROXY_PARSE_SHORT;
	if (ip6->version != 6)
		return PYPROXY_PARSE_SKIP;

	__builtin_memcpy(&p->saddr, &ip6->saddr, sizeof(p->saddr));
	__builtin_memcpy(&p->daddr, &ip6->daddr, sizeof(p->daddr));
	p->l3_off = sizeof(*eth);
	p->tcp_flags = 0;
	p->sport = 0;
	p->dport = 0;
	p->csum_off = 0;
	p->tcp_seq = 0;
	p->frag = PYPROXY_FRAG_NONE;
	p->frag_id = 0;
	p->tcp_hlen = 0;
	nexthdr = ip6->nexthdr;
	off = sizeof(*eth) + sizeof(*ip6);
	end = off + bpf_ntohs(ip6->payload_len);   /* one past the payload: no header may reach beyond it */

#pragma unroll
	for (int i = 0; i < PYPROXY_IPV6_EXT_MAX; i++) {
		__u8 *h;

		if (!pyproxy_ipv6_ext(nexthdr))
			break;
		/* Every extension header here is at least 8 bytes: its next header and length come first. */
		h = data + off;
		if ((void *)(h + 8) > data_end)
			return PYPROXY_PARSE_SHORT;
		if (off + 8 > end)
			return PYPROXY_PARSE_SKIP;
		if (nexthdr == IPPROTO_FRAGMENT) {
			__u16 fo = bpf_ntohs(*(__be16 *)(h + 2));

			__builtin_memcpy(&p->frag_id, h + 4, sizeof(p->frag_id));
			nexthdr = h[0];
			off += 8;
			if (fo & PYPROXY_IPV6_FRAG_OFFSET) {
				if (nexthdr != IPPROTO_TCP && nexthdr != IPPROTO_UDP)
					return PYPROXY_PARSE_SKIP;
				p->frag = PYPROXY_FRAG_LATER;
				p->proto = nexthdr;
				p->l4_off = off;
				p->l4_len = end - off;
				return PYPROXY_PARSE_FRAG;
			}
			if (fo & PYPROXY_IPV6_FRAG_MF)
				p->frag = PYPROXY_FRAG_FIRST;
			continue;
		}
		nexthdr = h[0];
		off += (h[1] + 1) * 8;
	}
	/* Bounded for the verifier: five extension headers of at most 2,048 bytes each. */
	if (off > end || off > 0x3000)
		return PYPROXY_PARSE_SKIP;
	p->proto = nexthdr;
	p->l4_off = off;
	p->l4_len = end - off;
	if (nexthdr == IPPROTO_ICMPV6)
		return p->frag == PYPROXY_FRAG_NONE ? PYPROXY_PARSE_ICMP : PYPROXY_PARSE_SKIP;
	if (nexthdr != IPPROTO_TCP && nexthdr != IPPROTO_UDP)
		return PYPROXY_PARSE_SKIP;
	if (p->l4_len < sizeof(struct udphdr))
		return PYPROXY_PARSE_SKIP;

	return pyproxy_parse_l4(data, data_end, off, p->l4_len, nexthdr, &p->sport, &p->dport, &p->tcp_flags,
				&p->csum_off, &p->tcp_seq, &p->tcp_hlen);
}

#endif
