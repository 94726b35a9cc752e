/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * ICMP errors about translated flows (destination unreachable, "fragmentation needed" among them, time
 * exceeded, parameter problem). An error quotes the packet that caused it, as that packet was when the error
 * was made: after DNAT for a client's packet (client -> backend), before reverse NAT for a reply (frontend ->
 * client as the quote of an error sent to the frontend). The client's stack matches an error to its socket by
 * the quote, so the quote must read as the client's own packet (client -> frontend), and an error about a reply
 * must reach the backend with the quote it sent (backend -> client). Without this, path-MTU discovery through a
 * ClusterIP fails and port-unreachable errors are ignored until a timeout.
 *
 * TC only (XDP leaves ICMP to TC). The rewrite keeps every checksum exact, and each changed region's sum
 * invariant (quoted header with its checksum, quoted L4 header with the ICMP checksum), so an skb's
 * CHECKSUM_COMPLETE sum stays right too.
 */
#ifndef PYPROXY_ICMP_H
#define PYPROXY_ICMP_H

#include "pyproxy/csum.h"
#include "pyproxy/nat.h"
#include "pyproxy/parse.h"

/* RFC 792 (linux/icmp.h pulls in libc headers a BPF build cannot use). */
#define PYPROXY_ICMP_DEST_UNREACH  3
#define PYPROXY_ICMP_TIME_EXCEEDED 11
#define PYPROXY_ICMP_PARAMETERPROB 12

struct pyproxy_icmphdr {
	__u8 type;
	__u8 code;
	__u16 checksum;
	__be32 rest;    /* unused, pointer or next-hop MTU: left alone */
};

/* What pyproxy_icmp_parse finds in an ICMP error about a TCP or UDP packet. Offsets from the frame's start. */
struct pyproxy_icmp_err {
	__u32 icmp_off;    /* the ICMP header */
	__u32 in_l3;       /* the quoted IPv4 header */
	__u32 in_l4;       /* the quoted TCP/UDP header (its ports at least are there) */
	__u32 end;         /* one past the ICMP message */
	__be32 saddr;      /* the quoted packet's tuple */
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
};

/* How many bytes of an ICMP error TC pulls into the linear area: the deepest field rewritten is the quoted
 * TCP checksum, at most 14 + 60 + 8 + 60 + 18 bytes in. */
#define PYPROXY_ICMP_PULL 192

static __always_inline int pyproxy_icmp_parse(void *data, void *data_end, const struct pyproxy_pkt *p,
					      struct pyproxy_icmp_err *e)
{
	struct pyproxy_icmphdr *ic = data + (p->l4_off & 0x7f);
	struct iphdr *in;
	__be16 *ports;
	__u32 ihl;

	if ((void *)(ic + 1) > data_end)
		return 0;
	if (ic->type != PYPROXY_ICMP_DEST_UNREACH && ic->type != PYPROXY_ICMP_TIME_EXCEEDED &&
	    ic->type != PYPROXY_ICMP_PARAMETERPROB)
		return 0;
	e->icmp_off = p->l4_off & 0x7f;
	e->in_l3 = e->icmp_off + sizeof(*ic);
	in = data + (e->in_l3 & 0xff);
	if ((void *)(in + 1) > data_end)
		return 0;
	ihl = in->ihl * 4;
	if (in->version != 4 || ihl < sizeof(*in) || (in->protocol != IPPROTO_TCP && in->protocol != IPPROTO_UDP))
		return 0;
	/* A quoted later fragment has no ports to find its flow by. */
	if (in->frag_off & bpf_htons(PYPROXY_IP_OFFSET))
		return 0;
	e->in_l4 = e->in_l3 + ihl;
	ports = data + (e->in_l4 & 0xff);
	if ((void *)(ports + 2) > data_end)
		return 0;
	e->saddr = in->saddr;
	e->daddr = in->daddr;
	e->sport = ports[0];
	e->dport = ports[1];
	e->proto = in->protocol;
	e->end = p->l4_off + p->l4_len;
	return 1;
}

/* Rewrites the quote's `side` address and port (PYPROXY_NAT_DST: an error about a client's packet, going to
 * the client; PYPROXY_NAT_SRC: an error about a reply, going to the backend) to addr:port, and the outer
 * header's opposite address when it is the old one: the backend itself reported the error, or the error is
 * addressed to the frontend. Every checksum is updated incrementally: the quoted L4 checksum (when the quote
 * holds it), the quoted IPv4 header's, the ICMP checksum over all of it, and the outer IPv4 header's. */
static __always_inline int pyproxy_icmp_nat(void *data, void *data_end, const struct pyproxy_icmp_err *e, int side,
					    __be32 addr, __be16 port)
{
	struct iphdr *ip = data + sizeof(struct ethhdr);
	struct pyproxy_icmphdr *ic = data + (e->icmp_off & 0x7f);
	struct iphdr *in = data + (e->in_l3 & 0xff);
	__be16 *in_port = data + ((e->in_l4 + (side == PYPROXY_NAT_DST ? 2 : 0)) & 0xff);
	__u32 csum_at = e->in_l4 + (e->proto == IPPROTO_TCP ? __builtin_offsetof(struct tcphdr, check)
							     : __builtin_offsetof(struct udphdr, check));
	__u16 *in_csum = data + (csum_at & 0xff);
	__be32 old_addr, *outer;
	__be16 old_port;
	__u16 old, c;

	if ((void *)(ip + 1) > data_end || (void *)(ic + 1) > data_end || (void *)(in + 1) > data_end ||
	    (void *)(in_port + 1) > data_end)
		return -1;
	old_addr = side == PYPROXY_NAT_DST ? in->daddr : in->saddr;
	old_port = *in_port;

	/* The quoted L4 checksum covers its pseudo header: the address change counts as well as the port. */
	if (csum_at + 2 <= e->end && (void *)(in_csum + 1) <= data_end &&
	    !(e->proto == IPPROTO_UDP && *in_csum == 0)) {
		old = *in_csum;
		c = pyproxy_csum_replace(old, old_addr, addr);
		c = pyproxy_csum_replace(c, old_port, port);
		if (e->proto == IPPROTO_UDP && c == 0)
			c = 0xffff;
		*in_csum = c;
		ic->checksum = pyproxy_csum_replace(ic->checksum, old, c);
	}
	*in_port = port;
	ic->checksum = pyproxy_csum_replace(ic->checksum, old_port, port);

	old = in->check;
	in->check = pyproxy_csum_replace(old, old_addr, addr);
	ic->checksum = pyproxy_csum_replace(ic->checksum, old, in->check);
	if (side == PYPROXY_NAT_DST)
		in->daddr = addr;
	else
		in->saddr = addr;
	ic->checksum = pyproxy_csum_replace(ic->checksum, old_addr, addr);

	outer = side == PYPROXY_NAT_DST ? &ip->saddr : &ip->daddr;
	if (*outer == old_addr) {
		ip->check = pyproxy_csum_replace(ip->check, old_addr, addr);
		*outer = addr;
	}
	return 0;
}

#endif
