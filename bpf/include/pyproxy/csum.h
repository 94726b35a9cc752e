/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Incremental Internet checksum updates for XDP, which has no skb checksum helpers.
 * Words are summed as they sit in memory, so no byte swapping is needed (RFC 1071 sec. 2(B)). */
#ifndef PYPROXY_CSUM_H
#define PYPROXY_CSUM_H

#include <linux/types.h>

static __always_inline __u16 pyproxy_csum_fold(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* Sum of the two 16-bit words of a 32-bit value, and of their complements. */
static __always_inline __u32 pyproxy_csum_words(__u32 v)
{
	return (v & 0xffff) + (v >> 16);
}

static __always_inline __u32 pyproxy_csum_neg_words(__u32 v)
{
	return (__u16)~(v & 0xffff) + (__u16)~(v >> 16);
}

/* RFC 1624 eqn. 3 for a complete checksum: HC' = ~(~HC + ~m + m'). `from`/`to` are 32 bits; for a
 * 16-bit field pass it zero-extended (the zero word cancels out). */
static __always_inline __u16 pyproxy_csum_replace(__u16 check, __u32 from, __u32 to)
{
	__u32 s = (__u16)~check;

	s += pyproxy_csum_neg_words(from) + pyproxy_csum_words(to);
	return (__u16)~pyproxy_csum_fold(s);
}

/* A CHECKSUM_PARTIAL packet (a veth peer or a local socket offloaded the sum) carries in its L4 field
 * only the folded, uncomplemented pseudo-header sum; the rest is added on transmit. XDP cannot see
 * skb->ip_summed, and a complete checksum can hold the same value (one packet in 65535), so a field equal
 * to this sum is ambiguous: XDP leaves such a packet to TC, whose helpers know which form it is. */
static __always_inline __u16 pyproxy_pseudo_sum(__be32 saddr, __be32 daddr, __u8 proto, __u32 l4_len)
{
	__u32 s = pyproxy_csum_words(saddr) + pyproxy_csum_words(daddr);

	s += bpf_htons((__u16)proto) + bpf_htons((__u16)l4_len);
	return pyproxy_csum_fold(s);
}

#endif
