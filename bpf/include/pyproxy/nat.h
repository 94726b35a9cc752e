/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Rewriting one address and port of a parsed packet, with its IPv4 and TCP/UDP checksums.
 * TC uses the skb helpers, which also keep CHECKSUM_PARTIAL and CHECKSUM_COMPLETE skbs right;
 * XDP writes the bytes itself. */
#ifndef PYPROXY_NAT_H
#define PYPROXY_NAT_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include "pyproxy/csum.h"
#include "pyproxy/parse.h"

enum pyproxy_nat_side {
	PYPROXY_NAT_DST = 0,   /* DNAT: client -> frontend becomes client -> backend */
	PYPROXY_NAT_SRC = 1,   /* reverse NAT: backend -> client becomes frontend -> client */
};

static __always_inline __u32 pyproxy_addr_off(const struct pyproxy_pkt *p, int side)
{
	return p->l3_off + (side == PYPROXY_NAT_DST ? __builtin_offsetof(struct iphdr, daddr)
						    : __builtin_offsetof(struct iphdr, saddr));
}

/* Source and destination ports sit at the same offsets in TCP and UDP. */
static __always_inline __u32 pyproxy_port_off(const struct pyproxy_pkt *p, int side)
{
	return p->l4_off + (side == PYPROXY_NAT_DST ? __builtin_offsetof(struct udphdr, dest)
						    : __builtin_offsetof(struct udphdr, source));
}

static __always_inline int pyproxy_tc_nat(struct __sk_buff *skb, const struct pyproxy_pkt *p, int side,
					  __be32 addr, __be16 port)
{
	__be32 old_addr = side == PYPROXY_NAT_DST ? p->daddr : p->saddr;
	__be16 old_port = side == PYPROXY_NAT_DST ? p->dport : p->sport;
	/* A UDP checksum of 0 means "none": leave it, and never produce 0 for a real one. */
	__u64 l4f = p->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;

	/* A later fragment has no L4 header: the first fragment's checksum covers the whole datagram. */
	if (p->frag == PYPROXY_FRAG_LATER)
		goto l3;
	if (bpf_l4_csum_replace(skb, p->csum_off, old_addr, addr, l4f | BPF_F_PSEUDO_HDR | sizeof(addr)))
		return -1;
	if (old_port != port) {
		if (bpf_l4_csum_replace(skb, p->csum_off, old_port, port, l4f | sizeof(port)))
			return -1;
		if (bpf_skb_store_bytes(skb, pyproxy_port_off(p, side), &port, sizeof(port), 0))
			return -1;
	}
l3:
	if (bpf_l3_csum_replace(skb, p->l3_off + __builtin_offsetof(struct iphdr, check), old_addr, addr,
				sizeof(addr)))
		return -1;
	return bpf_skb_store_bytes(skb, pyproxy_addr_off(p, side), &addr, sizeof(addr), 0);
}

/* True when the L4 checksum field may be either a complete checksum or a CHECKSUM_PARTIAL pseudo-header
 * sum (see csum.h): XDP must not translate such a packet. */
static __always_inline int pyproxy_xdp_csum_ambiguous(struct xdp_md *ctx, const struct pyproxy_pkt *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u16 *check = data + (p->csum_off & 0x7f);

	if ((void *)(check + 1) > data_end)
		return 1;
	if (p->proto == IPPROTO_UDP && *check == 0)
		return 0;
	return *check == pyproxy_pseudo_sum(p->saddr, p->daddr, p->proto, p->l4_len);
}

static __always_inline int pyproxy_xdp_nat(struct xdp_md *ctx, const struct pyproxy_pkt *p, int side,
					   __be32 addr, __be16 port)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct iphdr *ip = data + sizeof(struct ethhdr);
	__be32 old_addr = side == PYPROXY_NAT_DST ? p->daddr : p->saddr;
	__be16 old_port = side == PYPROXY_NAT_DST ? p->dport : p->sport;
	__u16 *check;
	__be16 *l4port;

	/* Re-derive pointers the verifier can bound: p->l4_off is at most 14 + 60. */
	if ((void *)(ip + 1) > data_end || p->l4_off > 74)
		return -1;
	check = data + (p->csum_off & 0x7f);
	l4port = data + (pyproxy_port_off(p, side) & 0x7f);
	if ((void *)(check + 1) > data_end || (void *)(l4port + 1) > data_end)
		return -1;

	if (!(p->proto == IPPROTO_UDP && *check == 0)) {
		__u16 c = pyproxy_csum_replace(*check, old_addr, addr);

		c = pyproxy_csum_replace(c, old_port, port);
		if (p->proto == IPPROTO_UDP && c == 0)
			c = 0xffff;
		*check = c;
	}
	*l4port = port;
	ip->check = pyproxy_csum_replace(ip->check, old_addr, addr);
	if (side == PYPROXY_NAT_DST)
		ip->daddr = addr;
	else
		ip->saddr = addr;
	return 0;
}

/* The mark XDP leaves in a packet's metadata when it has translated it, so TC ingress, which runs next on the
 * same packet, takes it as done. Without it, TC would see a packet to an endpoint that no Service flow explains
 * and take it for a direct connection (ct.h, pyproxy_ct_untrack). */
#define PYPROXY_XDP_TRANSLATED 0x70797031   /* "pyp1" */

/* Makes room for the mark in front of the packet (the metadata area). */
static __always_inline int pyproxy_xdp_reserve_mark(struct xdp_md *ctx)
{
	/* Room left from before: BPF_PROG_TEST_RUN repeats the program on one buffer, and the area holds 32 bytes. */
	if ((long)ctx->data - (long)ctx->data_meta >= (long)sizeof(__u32))
		return 0;
	return bpf_xdp_adjust_meta(ctx, -(int)sizeof(__u32));
}

static __always_inline void pyproxy_xdp_mark(struct xdp_md *ctx)
{
	__u32 *mark = (void *)(long)ctx->data_meta;

	if ((void *)(mark + 1) <= (void *)(long)ctx->data)
		*mark = PYPROXY_XDP_TRANSLATED;
}

/* Whether XDP translated this packet already (TC ingress). */
static __always_inline int pyproxy_tc_xdp_translated(struct __sk_buff *skb)
{
	__u32 *mark = (void *)(long)skb->data_meta;

	return (void *)(mark + 1) <= (void *)(long)skb->data && *mark == PYPROXY_XDP_TRANSLATED;
}

/* TC ingress translated this packet: the next TC ingress pass on it, a device stacked above, leaves it alone (abi.h,
 * PYPROXY_TC_TRANSLATED: the kernel makes tc_index of the classid when the program returns TC_ACT_OK). */
static __always_inline void pyproxy_tc_mark(struct __sk_buff *skb)
{
	skb->tc_classid = PYPROXY_TC_TRANSLATED;
}

/* Whether this packet was translated already, by TC ingress on a device below this one or by XDP (the mark of
 * either): TC ingress then returns TC_ACT_OK at once. One field read for the common packet; an XDP mark is passed
 * on as TC's, so a device stacked above this one takes the packet as done even where the metadata would not reach
 * it (on this kernel it does: measured through a bridge and a macvlan). */
static __always_inline int pyproxy_tc_translated(struct __sk_buff *skb)
{
	if (skb->tc_index == PYPROXY_TC_TRANSLATED)
		return 1;
	if (!pyproxy_tc_xdp_translated(skb))
		return 0;
	pyproxy_tc_mark(skb);
	return 1;
}

#endif
