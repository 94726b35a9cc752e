/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Packet parsing shared by TC and XDP: both see the frame from the Ethernet header on. */
#ifndef PYPROXY_PARSE_H
#define PYPROXY_PARSE_H

#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>

#define PYPROXY_IP_MF     0x2000
#define PYPROXY_IP_OFFSET 0x1fff

/* TCP header flags (byte 13 of the header). */
#define PYPROXY_TCP_FIN 0x01
#define PYPROXY_TCP_SYN 0x02
#define PYPROXY_TCP_RST 0x04
#define PYPROXY_TCP_ACK 0x10

/* struct pyproxy_pkt.frag */
enum pyproxy_frag {
	PYPROXY_FRAG_NONE = 0,   /* a whole datagram */
	PYPROXY_FRAG_FIRST,      /* offset 0, more to come: carries the L4 header */
	PYPROXY_FRAG_LATER,      /* offset > 0: no L4 header; ports come from PYPROXY_MAP_FRAGS */
};

/* What NAT needs to know about a packet: its 5-tuple and where the headers are. */
struct pyproxy_pkt {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 tcp_flags;    /* PYPROXY_TCP_*; 0 for UDP */
	__u8 frag;         /* enum pyproxy_frag */
	__u8 tcp_hlen;     /* TCP: its header's length (data offset x 4; 0 for UDP), for pyproxy_tcp_end */
	__be16 ip_id;      /* the IPv4 identification, for fragments */
	__u32 l3_off;      /* offset of the IPv4 header */
	__u32 l4_off;      /* offset of the TCP/UDP (or ICMP) header */
	__u32 l4_len;      /* TCP/UDP header + payload, from the IPv4 total length */
	__u32 csum_off;    /* offset of the TCP/UDP checksum field */
	__u32 tcp_seq;     /* host order; TCP: the segment's sequence number (0 for UDP) */
};

enum pyproxy_parse_result {
	PYPROXY_PARSE_OK = 0,    /* TCP or UDP: a whole datagram or its first fragment */
	PYPROXY_PARSE_SKIP,      /* not ours to translate: the stack will judge it */
	PYPROXY_PARSE_SHORT,     /* headers extend past the linear data (TC may pull and retry) */
	PYPROXY_PARSE_FRAG,      /* a later fragment of a TCP/UDP datagram: addresses and ip_id only */
	PYPROXY_PARSE_ICMP,      /* ICMP: l4_off is its header (icmp.h reads errors) */
};

static __always_inline int pyproxy_is_syn(const struct pyproxy_pkt *p)
{
	return (p->tcp_flags & (PYPROXY_TCP_SYN | PYPROXY_TCP_ACK)) == PYPROXY_TCP_SYN;
}

/* The end of the sequence space a TCP segment of `l4_len` bytes (header `hlen` included) covers: seq + payload + SYN
 * + FIN; 0 for UDP (hlen 0), whose entries so never store one. A header longer than the segment makes an end behind
 * seq, which moves nothing (ct.h). */
static __always_inline __u32 pyproxy_tcp_end(__u32 seq, __u32 l4_len, __u8 hlen, __u8 tcp_flags)
{
	if (!hlen)
		return 0;
	return seq + l4_len - hlen + ((tcp_flags & PYPROXY_TCP_SYN) >> 1) + (tcp_flags & PYPROXY_TCP_FIN);
}

/* A packet's sequence number, read from its struct pyproxy_pkt or pyproxy_pkt6 where it is used: the programs' stack
 * has no room for a copy kept across their calls (the IPv6 ones' is full), so the read is not cached. */
static __always_inline __u32 pyproxy_pkt_seq(const __u32 *seq)
{
	return *(const volatile __u32 *)seq;
}

static __always_inline __u32 pyproxy_pkt_end(const __u32 *seq, __u32 l4_len, const __u8 *hlen, __u8 tcp_flags)
{
	return pyproxy_tcp_end(pyproxy_pkt_seq(seq), l4_len, *(const volatile __u8 *)hlen, tcp_flags);
}

/* The TCP or UDP header at `off` (`l4_len` bytes with its payload), both families: its ports, flags and checksum
 * offset. */
static __always_inline int pyproxy_parse_l4(void *data, void *data_end, __u32 off, __u32 l4_len, __u8 proto,
					    __be16 *sport, __be16 *dport, __u8 *tcp_flags, __u32 *csum_off, __u32 *seq,
					    __u8 *hlen)
{
	if (proto == IPPROTO_TCP) {
		struct tcphdr *th = data + off;

		if ((void *)(th + 1) > data_end)
			return PYPROXY_PARSE_SHORT;
		if (l4_len < sizeof(*th))
			return PYPROXY_PARSE_SKIP;
		*sport = th->source;
		*dport = th->dest;
		*tcp_flags = ((__u8 *)th)[13];
		*csum_off = off + __builtin_offsetof(struct tcphdr, check);
		/* Where the segment sits in its sender's sequence space, for the RST window (ct.h). */
		*seq = bpf_ntohl(th->seq);
		*hlen = th->doff * 4;
	} else {
		struct udphdr *uh = data + off;

		if ((void *)(uh + 1) > data_end)
			return PYPROXY_PARSE_SHORT;
		*sport = uh->source;
		*dport = uh->dest;
		*csum_off = off + __builtin_offsetof(struct udphdr, check);
	}
	return PYPROXY_PARSE_OK;
}

/* Fills *p for an IPv4 TCP or UDP packet. Malformed headers are SKIP so the caller passes the packet
 * untouched; fragments and ICMP get their own results, for TC (XDP leaves them to TC). `len`: the packet's length
 * from its link header as the stack holds it (TC: skb->len; 0 where no packet can be longer than 64 KB, XDP): a TCP
 * packet over 64 KB is a BIG TCP one (GRO or GSO, kernels since 6.3), whose IPv4 total length reads 0. */
static __always_inline int pyproxy_parse_len(void *data, void *data_end, struct pyproxy_pkt *p, __u32 len)
{
	struct ethhdr *eth = data;
	struct iphdr *ip;
	__u32 ihl, tot_len;
	__u16 frag_off;

	if ((void *)(eth + 1) > data_end)
		return PYPROXY_PARSE_SHORT;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return PYPROXY_PARSE_SKIP;
	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return PYPROXY_PARSE_SHORT;
	ihl = ip->ihl * 4;
	tot_len = bpf_ntohs(ip->tot_len);
	/* A length of 0 is settled before it meets ihl: 6.1's verifier, comparing the two with tot_len known 0, kept
	 * following the impossible branch (ihl at most 0 and at least 20) and refused the program further on. */
	if (!tot_len) {
		if (ip->protocol != IPPROTO_TCP || len <= 0xffff + sizeof(*eth))
			return PYPROXY_PARSE_SKIP;
		tot_len = len - sizeof(*eth);
	}
	if (ip->version != 4 || ihl < sizeof(*ip) || tot_len < ihl)
		return PYPROXY_PARSE_SKIP;

	p->l3_off = sizeof(*eth);
	p->l4_off = sizeof(*eth) + ihl;
	p->l4_len = tot_len - ihl;
	p->saddr = ip->saddr;
	p->daddr = ip->daddr;
	p->proto = ip->protocol;
	p->ip_id = ip->id;
	p->tcp_flags = 0;
	p->sport = 0;
	p->dport = 0;
	p->csum_off = 0;
	p->tcp_seq = 0;
	p->tcp_hlen = 0;
	if (ip->protocol == IPPROTO_ICMP)
		return ip->frag_off & bpf_htons(PYPROXY_IP_MF | PYPROXY_IP_OFFSET) ? PYPROXY_PARSE_SKIP : PYPROXY_PARSE_ICMP;
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return PYPROXY_PARSE_SKIP;
	frag_off = bpf_ntohs(ip->frag_off);
	if (frag_off & PYPROXY_IP_OFFSET) {
		p->frag = PYPROXY_FRAG_LATER;
		return PYPROXY_PARSE_FRAG;
	}
	p->frag = frag_off & PYPROXY_IP_MF ? PYPROXY_FRAG_FIRST : PYPROXY_FRAG_NONE;
	if (p->l4_len < sizeof(struct udphdr))
		return PYPROXY_PARSE_SKIP;

	return pyproxy_parse_l4(data, data_end, p->l4_off, p->l4_len, p->proto, &p->sport, &p->dport, &p->tcp_flags,
				&p->csum_off, &p->tcp_seq, &p->tcp_hlen);
}

static __always_inline int pyproxy_parse(void *data, void *data_end, struct pyproxy_pkt *p)
{
	return pyproxy_parse_len(data, data_end, p, 0);
}

#endif
