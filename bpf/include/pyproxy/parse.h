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

/* What NAT needs to know about a packet: its 5-tuple and where the headers are. */
struct pyproxy_pkt {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u32 l3_off;      /* offset of the IPv4 header */
	__u32 l4_off;      /* offset of the TCP/UDP header */
	__u32 l4_len;      /* TCP/UDP header + payload, from the IPv4 total length */
	__u32 csum_off;    /* offset of the TCP/UDP checksum field */
};

enum pyproxy_parse_result {
	PYPROXY_PARSE_OK = 0,
	PYPROXY_PARSE_SKIP,      /* not IPv4 TCP/UDP, or a fragment: not ours to translate */
	PYPROXY_PARSE_SHORT,     /* headers extend past the linear data (TC may pull and retry) */
};

/* Fills *p for an unfragmented IPv4 TCP or UDP packet. Anything else, including malformed headers,
 * is SKIP so the caller passes it untouched: the stack will judge it. */
static __always_inline int pyproxy_parse(void *data, void *data_end, struct pyproxy_pkt *p)
{
	struct ethhdr *eth = data;
	struct iphdr *ip;
	__u32 ihl;

	if ((void *)(eth + 1) > data_end)
		return PYPROXY_PARSE_SHORT;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return PYPROXY_PARSE_SKIP;
	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return PYPROXY_PARSE_SHORT;
	ihl = ip->ihl * 4;
	if (ip->version != 4 || ihl < sizeof(*ip))
		return PYPROXY_PARSE_SKIP;
	/* Later fragments carry no ports; translating only the first would split the datagram. */
	if (ip->frag_off & bpf_htons(PYPROXY_IP_MF | PYPROXY_IP_OFFSET))
		return PYPROXY_PARSE_SKIP;
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return PYPROXY_PARSE_SKIP;
	if (bpf_ntohs(ip->tot_len) < ihl + sizeof(struct udphdr))
		return PYPROXY_PARSE_SKIP;

	p->l3_off = sizeof(*eth);
	p->l4_off = sizeof(*eth) + ihl;
	p->l4_len = bpf_ntohs(ip->tot_len) - ihl;
	p->saddr = ip->saddr;
	p->daddr = ip->daddr;
	p->proto = ip->protocol;

	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *th = data + p->l4_off;

		if ((void *)(th + 1) > data_end)
			return PYPROXY_PARSE_SHORT;
		if (p->l4_len < sizeof(*th))
			return PYPROXY_PARSE_SKIP;
		p->sport = th->source;
		p->dport = th->dest;
		p->csum_off = p->l4_off + __builtin_offsetof(struct tcphdr, check);
	} else {
		struct udphdr *uh = data + p->l4_off;

		if ((void *)(uh + 1) > data_end)
			return PYPROXY_PARSE_SHORT;
		p->sport = uh->source;
		p->dport = uh->dest;
		p->csum_off = p->l4_off + __builtin_offsetof(struct udphdr, check);
	}
	return PYPROXY_PARSE_OK;
}

#endif
