/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Refusing an IPv6 flow to a frontend with no usable endpoint: reject.h's twin. TCP: the segment turned into a
 * reset in place (reject.h's TCP half is shared; swapping the addresses changes no checksum). UDP: an ICMPv6
 * destination unreachable, port unreachable (RFC 4443 sec. 3.1) from the frontend, quoting the datagram's IPv6
 * header and first 8 bytes, its checksum over the ICMPv6 pseudo header. Packets with extension headers,
 * fragments, resets and GSO batches are dropped instead (no answer is better than a wrong one).
 */
#ifndef PYPROXY_REJECT6_H
#define PYPROXY_REJECT6_H

#include "pyproxy/icmp6.h"
#include "pyproxy/parse6.h"
#include "pyproxy/reject.h"

#define PYPROXY_IPV6_PLAIN (sizeof(struct ethhdr) + sizeof(struct ipv6hdr))

static __always_inline int pyproxy_swap_link_and_net6(struct __sk_buff *skb, const struct pyproxy_pkt6 *p)
{
	if (pyproxy_swap_link(skb))
		return -1;
	if (bpf_skb_store_bytes(skb, p->l3_off + __builtin_offsetof(struct ipv6hdr, saddr), &p->daddr, 16, 0) ||
	    bpf_skb_store_bytes(skb, p->l3_off + __builtin_offsetof(struct ipv6hdr, daddr), &p->saddr, 16, 0))
		return -1;
	return 0;
}

static __always_inline int pyproxy_reject6_tcp(struct __sk_buff *skb, const struct pyproxy_pkt6 *p)
{
	if (pyproxy_tcp_reset(skb, p->l4_off, p->csum_off, p->l4_len, p->sport, p->dport) ||
	    pyproxy_swap_link_and_net6(skb, p))
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

struct pyproxy_icmp6_answer {
	struct ethhdr eth;
	struct ipv6hdr ip6;
	struct pyproxy_icmphdr icmp;   /* type, code, checksum, 4 unused bytes: ICMPv6's error header too */
} __attribute__((packed));

#define PYPROXY_QUOTE6_LEN (sizeof(struct ipv6hdr) + 8)
#define PYPROXY_ANSWER6_ROOM (sizeof(struct ipv6hdr) + sizeof(struct pyproxy_icmphdr))

static __always_inline int pyproxy_reject6_udp(struct __sk_buff *skb, const struct pyproxy_pkt6 *p)
{
	struct pyproxy_icmp6_answer a = {};
	__u8 quote[PYPROXY_QUOTE6_LEN];
	__u32 s;

	if (bpf_skb_load_bytes(skb, __builtin_offsetof(struct ethhdr, h_source), a.eth.h_dest, ETH_ALEN) ||
	    bpf_skb_load_bytes(skb, __builtin_offsetof(struct ethhdr, h_dest), a.eth.h_source, ETH_ALEN) ||
	    bpf_skb_load_bytes(skb, p->l3_off, quote, sizeof(quote)))
		return TC_ACT_SHOT;
	a.eth.h_proto = bpf_htons(ETH_P_IPV6);
	a.ip6.version = 6;
	a.ip6.payload_len = bpf_htons(sizeof(a.icmp) + PYPROXY_QUOTE6_LEN);
	a.ip6.nexthdr = IPPROTO_ICMPV6;
	a.ip6.hop_limit = 64;
	__builtin_memcpy(&a.ip6.saddr, &p->daddr, 16);
	__builtin_memcpy(&a.ip6.daddr, &p->saddr, 16);
	a.icmp.type = PYPROXY_ICMP6_DEST_UNREACH;
	a.icmp.code = PYPROXY_ICMP6_PORT_UNREACH;
	/* The ICMPv6 checksum covers a pseudo header: both addresses, the upper-layer length and next header. */
	s = pyproxy_sum_words(&a.ip6.saddr, 16) + bpf_htons(sizeof(a.icmp) + PYPROXY_QUOTE6_LEN) +
	    bpf_htons(IPPROTO_ICMPV6);
	s += pyproxy_sum_words(&a.icmp, sizeof(a.icmp) / 2) + pyproxy_sum_words(quote, sizeof(quote) / 2);
	a.icmp.checksum = ~pyproxy_csum_fold(s);

	/* [eth][ip6][udp ...] -> [room 48][eth][ip6][udp ...] -> [eth'][ip6'][icmp6][ip6][udp 8 bytes] */
	if (bpf_skb_change_head(skb, PYPROXY_ANSWER6_ROOM, 0) ||
	    bpf_skb_change_tail(skb, sizeof(a) + PYPROXY_QUOTE6_LEN, 0) ||
	    bpf_skb_store_bytes(skb, 0, &a, sizeof(a), 0))
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

static __always_inline int pyproxy_tc_reject6(struct __sk_buff *skb, const struct pyproxy_pkt6 *p)
{
	if (p->l4_off != PYPROXY_IPV6_PLAIN || p->frag != PYPROXY_FRAG_NONE || skb->gso_segs > 1 ||
	    !pyproxy_refusal_allowed())
		return TC_ACT_SHOT;
	return p->proto == IPPROTO_TCP ? pyproxy_reject6_tcp(skb, p) : pyproxy_reject6_udp(skb, p);
}

#endif
