/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Refusing a flow to a frontend with no usable endpoint, as upstream's REJECT does: the client fails at once
 * instead of retrying until a timeout. TC only (XDP leaves such packets to TC): the answer leaves through the
 * device the packet came in on (bpf_redirect to its egress), addressed back to the sender.
 *
 * - TCP: a reset, made by turning the segment around in place (RFC 793 sec. 3.4: SEQ from its ACK, or ACK
 *   covering it). Nothing changes length, and every checksum is updated incrementally with the skb helpers, so
 *   the reset is right whether the segment's checksum was complete or left to offload (CHECKSUM_PARTIAL, a
 *   local or veth sender's).
 * - UDP: an ICMP port unreachable from the frontend, quoting the datagram's IPv4 header and first 8 bytes
 *   (RFC 792), built in front of the datagram and cut to that length.
 * Packets with IPv4 options, resets and GSO batches are dropped instead (no answer is better than a wrong one).
 */
#ifndef PYPROXY_REJECT_H
#define PYPROXY_REJECT_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include "pyproxy/counters.h"
#include "pyproxy/csum.h"
#include "pyproxy/icmp.h"
#include "pyproxy/parse.h"

#define PYPROXY_IPV4_PLAIN (sizeof(struct ethhdr) + sizeof(struct iphdr))   /* the L4 offset without options */

/* Swaps the link addresses: the answer goes back to the sender's. */
static __always_inline int pyproxy_swap_link(struct __sk_buff *skb)
{
	struct ethhdr eth;
	__u8 tmp[ETH_ALEN];

	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return -1;
	__builtin_memcpy(tmp, eth.h_dest, ETH_ALEN);
	__builtin_memcpy(eth.h_dest, eth.h_source, ETH_ALEN);
	__builtin_memcpy(eth.h_source, tmp, ETH_ALEN);
	return bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) ? -1 : 0;
}

static __always_inline int pyproxy_swap_link_and_net(struct __sk_buff *skb, const struct pyproxy_pkt *p)
{
	if (pyproxy_swap_link(skb))
		return -1;
	/* Swapping the addresses changes no checksum: the IPv4 and pseudo-header sums stay the same. */
	if (bpf_skb_store_bytes(skb, p->l3_off + __builtin_offsetof(struct iphdr, saddr), &p->daddr, 4, 0) ||
	    bpf_skb_store_bytes(skb, p->l3_off + __builtin_offsetof(struct iphdr, daddr), &p->saddr, 4, 0))
		return -1;
	return 0;
}

/* Replaces a 4-byte (`size` 4) or 2-byte field of the TCP header at `l4_off` + `off`, checksum included. */
static __always_inline int pyproxy_tcp_set(struct __sk_buff *skb, __u32 l4_off, __u32 csum_off, __u32 off, __u32 old,
					   __u32 new, __u32 size)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, csum_off, old, new, size))
		return -1;
	return bpf_skb_store_bytes(skb, l4_off + off, &new, size, 0);
}

/* The address-independent half of a reset, shared by both families: the segment at `l4_off` (`l4_len` bytes with
 * its payload) turned around in place. Non-zero: no reset (the segment is one already, or a helper failed). */
static __always_inline int pyproxy_tcp_reset(struct __sk_buff *skb, __u32 l4_off, __u32 csum_off, __u32 l4_len,
					     __be16 sport, __be16 dport)
{
	struct tcphdr th;
	__u32 seq, ack, len;
	__u16 old_word, new_word, zero = 0;
	__u8 flags;

	if (bpf_skb_load_bytes(skb, l4_off, &th, sizeof(th)))
		return -1;
	flags = ((__u8 *)&th)[13];
	if (flags & PYPROXY_TCP_RST)
		return -1;
	len = l4_len - th.doff * 4 + !!(flags & PYPROXY_TCP_SYN) + !!(flags & PYPROXY_TCP_FIN);
	if (flags & PYPROXY_TCP_ACK) {
		seq = th.ack_seq;
		ack = 0;
		flags = PYPROXY_TCP_RST;
	} else {
		seq = 0;
		ack = bpf_htonl(bpf_ntohl(th.seq) + len);
		flags = PYPROXY_TCP_RST | PYPROXY_TCP_ACK;
	}
	__builtin_memcpy(&old_word, (__u8 *)&th + 12, 2);
	new_word = old_word;
	((__u8 *)&new_word)[0] &= 0xf0;   /* keep the data offset, clear the reserved bits */
	((__u8 *)&new_word)[1] = flags;
	/* Swapping the ports changes no checksum either. */
	if (bpf_skb_store_bytes(skb, l4_off + __builtin_offsetof(struct tcphdr, source), &dport, 2, 0) ||
	    bpf_skb_store_bytes(skb, l4_off + __builtin_offsetof(struct tcphdr, dest), &sport, 2, 0) ||
	    pyproxy_tcp_set(skb, l4_off, csum_off, __builtin_offsetof(struct tcphdr, seq), th.seq, seq, 4) ||
	    pyproxy_tcp_set(skb, l4_off, csum_off, __builtin_offsetof(struct tcphdr, ack_seq), th.ack_seq, ack, 4) ||
	    pyproxy_tcp_set(skb, l4_off, csum_off, 12, old_word, new_word, 2) ||
	    pyproxy_tcp_set(skb, l4_off, csum_off, __builtin_offsetof(struct tcphdr, window), th.window, zero, 2))
		return -1;
	return 0;
}

static __always_inline int pyproxy_reject_tcp(struct __sk_buff *skb, const struct pyproxy_pkt *p)
{
	if (pyproxy_tcp_reset(skb, p->l4_off, p->csum_off, p->l4_len, p->sport, p->dport) ||
	    pyproxy_swap_link_and_net(skb, p))
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

/* The answer to a UDP datagram, as it will stand in front of the quote. */
struct pyproxy_icmp_answer {
	struct ethhdr eth;
	struct iphdr ip;
	struct pyproxy_icmphdr icmp;
} __attribute__((packed));

#define PYPROXY_QUOTE_LEN (sizeof(struct iphdr) + 8)
#define PYPROXY_ANSWER_ROOM (sizeof(struct iphdr) + sizeof(struct pyproxy_icmphdr))

/* One's complement sum of `n` 16-bit words as they sit in memory (n a constant: the loop unrolls). */
static __always_inline __u32 pyproxy_sum_words(const void *buf, int n)
{
	const __u16 *w = buf;
	__u32 s = 0;

#pragma unroll
	for (int i = 0; i < n; i++)
		s += w[i];
	return s;
}

static __always_inline int pyproxy_reject_udp(struct __sk_buff *skb, const struct pyproxy_pkt *p)
{
	struct pyproxy_icmp_answer a = {};
	__u8 quote[PYPROXY_QUOTE_LEN];
	__u32 s;

	/* Back to the sender: its link address becomes the destination, ours the source. */
	if (bpf_skb_load_bytes(skb, __builtin_offsetof(struct ethhdr, h_source), a.eth.h_dest, ETH_ALEN) ||
	    bpf_skb_load_bytes(skb, __builtin_offsetof(struct ethhdr, h_dest), a.eth.h_source, ETH_ALEN) ||
	    bpf_skb_load_bytes(skb, p->l3_off, quote, sizeof(quote)))
		return TC_ACT_SHOT;
	a.eth.h_proto = bpf_htons(ETH_P_IP);
	a.ip.version = 4;
	a.ip.ihl = 5;
	a.ip.tos = 0xc0;   /* IPTOS_PREC_INTERNETCONTROL, as the kernel's own ICMP errors */
	a.ip.tot_len = bpf_htons(PYPROXY_ANSWER_ROOM + PYPROXY_QUOTE_LEN);
	a.ip.ttl = 64;
	a.ip.protocol = IPPROTO_ICMP;
	a.ip.saddr = p->daddr;
	a.ip.daddr = p->saddr;
	a.ip.check = ~pyproxy_csum_fold(pyproxy_sum_words(&a.ip, sizeof(a.ip) / 2));
	a.icmp.type = PYPROXY_ICMP_DEST_UNREACH;
	a.icmp.code = 3;   /* port unreachable */
	s = pyproxy_sum_words(&a.icmp, sizeof(a.icmp) / 2) + pyproxy_sum_words(quote, sizeof(quote) / 2);
	a.icmp.checksum = ~pyproxy_csum_fold(s);

	/* [eth][ip][udp ...] -> [room 28][eth][ip][udp ...] -> [eth'][ip'][icmp][ip][udp 8 bytes] */
	if (bpf_skb_change_head(skb, PYPROXY_ANSWER_ROOM, 0) ||
	    bpf_skb_change_tail(skb, sizeof(a) + PYPROXY_QUOTE_LEN, 0) ||
	    bpf_skb_store_bytes(skb, 0, &a, sizeof(a), 0))
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

/* Whether this CPU may send one more refusal now (PYPROXY_MAP_REFUSALS' bucket), both families: else the packet is
 * dropped, counted, and its client retries or times out. The clock is read only here: refusals are rare but for
 * a flood. */
static __always_inline int pyproxy_refusal_allowed(void)
{
	__u32 zero = 0;
	struct pyproxy_refusal_bucket *b = bpf_map_lookup_elem(&PYPROXY_MAP_REFUSALS, &zero);
	__u64 now, cost = pyproxy_config.refusal.ns_per_refusal, credit;

	if (!b)
		return 1;
	now = bpf_ktime_get_ns();
	credit = b->credit_ns + (now - b->last_ns);   /* the first refusal finds last_ns 0: a full bucket */
	if (credit > cost * pyproxy_config.refusal.burst)
		credit = cost * pyproxy_config.refusal.burst;
	b->last_ns = now;
	if (credit < cost) {
		b->credit_ns = credit;
		pyproxy_count(PYPROXY_CNT_REFUSAL_LIMITED);
		return 0;
	}
	b->credit_ns = credit - cost;
	return 1;
}

/* Answers a packet to a frontend that has no usable endpoint; returns the TC verdict. */
static __always_inline int pyproxy_tc_reject(struct __sk_buff *skb, const struct pyproxy_pkt *p)
{
	if (p->l4_off != PYPROXY_IPV4_PLAIN || p->frag != PYPROXY_FRAG_NONE || skb->gso_segs > 1 ||
	    !pyproxy_refusal_allowed())
		return TC_ACT_SHOT;
	return p->proto == IPPROTO_TCP ? pyproxy_reject_tcp(skb, p) : pyproxy_reject_udp(skb, p);
}

#endif
