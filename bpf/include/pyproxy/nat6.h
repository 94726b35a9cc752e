/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Rewriting one address and port of a parsed IPv6 packet: nat.h's twin. IPv6 has no header checksum; the TCP/UDP
 * checksum covers the addresses through its pseudo header, so a 16-byte address change is folded into it as one
 * difference (bpf_csum_diff, then bpf_l4_csum_replace with BPF_F_PSEUDO_HDR, which keeps CHECKSUM_PARTIAL and
 * CHECKSUM_COMPLETE skbs right as for IPv4). XDP updates the checksum word by word itself.
 */
#ifndef PYPROXY_NAT6_H
#define PYPROXY_NAT6_H

#include "pyproxy/nat.h"
#include "pyproxy/parse6.h"

/* The bound the verifier is shown for offsets into an IPv6 packet's headers (parse6.h stops at 0x3000). */
#define PYPROXY_IPV6_OFF_MASK 0x3fff

static __always_inline __u32 pyproxy_addr6_off(const struct pyproxy_pkt6 *p, int side)
{
	return p->l3_off + (side == PYPROXY_NAT_DST ? __builtin_offsetof(struct ipv6hdr, daddr)
						    : __builtin_offsetof(struct ipv6hdr, saddr));
}

static __always_inline __u32 pyproxy_port6_off(const struct pyproxy_pkt6 *p, int side)
{
	return p->l4_off + (side == PYPROXY_NAT_DST ? __builtin_offsetof(struct udphdr, dest)
						    : __builtin_offsetof(struct udphdr, source));
}

static __always_inline int pyproxy_tc_nat6(struct __sk_buff *skb, const struct pyproxy_pkt6 *p, int side,
					   const struct pyproxy_in6 *addr, __be16 port)
{
	const struct pyproxy_in6 *old = side == PYPROXY_NAT_DST ? &p->daddr : &p->saddr;
	__be16 old_port = side == PYPROXY_NAT_DST ? p->dport : p->sport;
	__u64 l4f = p->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
	__s64 diff;

	/* A later fragment has no L4 header: the first fragment's checksum covers the whole datagram. */
	if (p->frag != PYPROXY_FRAG_LATER) {
		diff = bpf_csum_diff((void *)old, sizeof(*old), (void *)addr, sizeof(*addr), 0);
		if (bpf_l4_csum_replace(skb, p->csum_off, 0, diff, l4f | BPF_F_PSEUDO_HDR))
			return -1;
		if (old_port != port) {
			if (bpf_l4_csum_replace(skb, p->csum_off, old_port, port, l4f | sizeof(port)))
				return -1;
			if (bpf_skb_store_bytes(skb, pyproxy_port6_off(p, side), &port, sizeof(port), 0))
				return -1;
		}
	}
	return bpf_skb_store_bytes(skb, pyproxy_addr6_off(p, side), addr, sizeof(*addr), 0);
}

/* The pseudo-header sum a CHECKSUM_PARTIAL IPv6 packet carries in its L4 field (pyproxy_pseudo_sum's twin). */
static __always_inline __u16 pyproxy_pseudo_sum6(const struct pyproxy_pkt6 *p)
{
	__u32 s = 0;

#pragma unroll
	for (int i = 0; i < 4; i++)
		s += pyproxy_csum_words(p->saddr.w[i]) + pyproxy_csum_words(p->daddr.w[i]);
	s += bpf_htons((__u16)p->proto) + bpf_htons((__u16)p->l4_len);
	return pyproxy_csum_fold(s);
}

/* RFC 1624 eqn. 3 for an address (16 bytes) and a port changed at once: one sum, folded once (five
 * pyproxy_csum_replace calls fold ten times; this is the XDP established path's). */
static __always_inline __u16 pyproxy_csum_replace6(__u16 check, const struct pyproxy_in6 *from,
						   const struct pyproxy_in6 *to, __be16 from_port, __be16 to_port)
{
	__u32 s = (__u16)~check + (__u16)~from_port + to_port;

#pragma unroll
	for (int i = 0; i < 4; i++)
		s += pyproxy_csum_neg_words(from->w[i]) + pyproxy_csum_words(to->w[i]);
	return (__u16)~pyproxy_csum_fold(s);
}

static __always_inline int pyproxy_xdp_csum_ambiguous6(struct xdp_md *ctx, const struct pyproxy_pkt6 *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u16 *check = data + (p->csum_off & PYPROXY_IPV6_OFF_MASK);

	if ((void *)(check + 1) > data_end)
		return 1;
	if (p->proto == IPPROTO_UDP && *check == 0)
		return 0;
	return *check == pyproxy_pseudo_sum6(p);
}

static __always_inline int pyproxy_xdp_nat6(struct xdp_md *ctx, const struct pyproxy_pkt6 *p, int side,
					    const struct pyproxy_in6 *addr, __be16 port)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);
	const struct pyproxy_in6 *old = side == PYPROXY_NAT_DST ? &p->daddr : &p->saddr;
	__be16 old_port = side == PYPROXY_NAT_DST ? p->dport : p->sport;
	__u16 *check;
	__be16 *l4port;
	__u16 c;

	if ((void *)(ip6 + 1) > data_end)
		return -1;
	check = data + (p->csum_off & PYPROXY_IPV6_OFF_MASK);
	l4port = data + (pyproxy_port6_off(p, side) & PYPROXY_IPV6_OFF_MASK);
	if ((void *)(check + 1) > data_end || (void *)(l4port + 1) > data_end)
		return -1;

	if (!(p->proto == IPPROTO_UDP && *check == 0)) {
		c = pyproxy_csum_replace6(*check, old, addr, old_port, port);
		if (p->proto == IPPROTO_UDP && c == 0)
			c = 0xffff;
		*check = c;
	}
	*l4port = port;
	if (side == PYPROXY_NAT_DST)
		__builtin_memcpy(&ip6->daddr, addr, sizeof(*addr));
	else
		__builtin_memcpy(&ip6->saddr, addr, sizeof(*addr));
	return 0;
}

#endif
