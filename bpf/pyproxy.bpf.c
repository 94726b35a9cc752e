// SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0)
/*
 * pyproxy's datapath entry points. Each is thin: parse, ask lb.h where the packet goes, rewrite with
 * nat.h. The control plane fills the maps (maps.h); nothing here allocates or decides policy.
 *
 * Where each step runs, and why:
 *  - DNAT on TC ingress (or XDP) of every managed device, before routing and netfilter: the node then
 *    routes, filters and conntracks the packet as client -> backend, like any routed packet.
 *  - Reverse NAT on TC egress, after routing and netfilter: the node's conntrack saw the reply as
 *    backend -> client (ESTABLISHED, not INVALID) and strict reverse-path filtering checked the
 *    backend's address against the interface it really came in on.
 *  - SNAT (snat.h) the same way round: the source is written on TC egress (a packet entering with a node
 *    address as its source would be a martian), a reply to an SNAT port gets its client back on ingress.
 *  - A device stacked over another (a bridge over its port, a macvlan over its lower device) runs TC ingress on
 *    the same packet again, after the rewrite: what TC ingress translated carries a mark (abi.h,
 *    PYPROXY_TC_TRANSLATED; XDP's, nat.h), and a pass that finds one leaves the packet alone. TC egress needs none:
 *    a packet leaving through such a stack (the bridge, then its port) meets the second program with its tuple
 *    already translated, which no flow's entry is keyed by, and passes untouched (seen end to end with programs on
 *    both devices, tests/e2e/test_stacked_devices_e2e.py).
 *
 * IPv6 has programs of its own, the `6` twins below, which the IPv4 entry points tail-call when the frame is IPv6
 * (PYPROXY_MAP_JUMP6, PYPROXY_MAP_XJUMP6): the dispatch sits where the IPv4 parser has already said "not IPv4",
 * so IPv4 packets run the very code they ran before, and each family's program is verified on its own.
 */
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "pyproxy/frag.h"
#include "pyproxy/icmp6.h"
#include "pyproxy/lb.h"
#include "pyproxy/lb6.h"
#include "pyproxy/nat.h"
#include "pyproxy/nat6.h"
#include "pyproxy/reject.h"
#include "pyproxy/reject6.h"
#include "pyproxy/sock.h"

/* Whether a frame the IPv4 parser skipped is IPv6 (its link header is there: the parser read it). */
static __always_inline int pyproxy_is_ipv6(void *data, void *data_end)
{
	struct ethhdr *eth = data;

	return (void *)(eth + 1) <= data_end && eth->h_proto == bpf_htons(ETH_P_IPV6);
}

/* Parses an skb, pulling headers into the linear area once if they straddle it. */
static __always_inline int pyproxy_tc_parse(struct __sk_buff *skb, struct pyproxy_pkt *p)
{
	int r = pyproxy_parse_len((void *)(long)skb->data, (void *)(long)skb->data_end, p, skb->len);

	if (r == PYPROXY_PARSE_SHORT && skb->len > skb->data_end - skb->data) {
		__u32 want = skb->len < 128 ? skb->len : 128;

		if (bpf_skb_pull_data(skb, want))
			return PYPROXY_PARSE_SKIP;
		r = pyproxy_parse_len((void *)(long)skb->data, (void *)(long)skb->data_end, p, skb->len);
	}
	/* A later fragment of a translated datagram takes its ports from the first fragment's record. */
	if (r == PYPROXY_PARSE_FRAG)
		r = pyproxy_frag_ports(p) ? PYPROXY_PARSE_OK : PYPROXY_PARSE_SKIP;
	return r;
}

/* An ICMP error about a translated flow gets the quote its receiver knows (icmp.h). `dir`: the CT entry that
 * holds the translation (REVERSE on egress, toward clients; FORWARD on ingress, toward frontends). */
static __always_inline int pyproxy_tc_icmp(struct __sk_buff *skb, const struct pyproxy_pkt *p, __u8 dir)
{
	struct pyproxy_icmp_err e;
	struct pyproxy_backend to;
	__u32 want = skb->len < PYPROXY_ICMP_PULL ? skb->len : PYPROXY_ICMP_PULL;

	if (bpf_skb_pull_data(skb, want))
		return TC_ACT_OK;
	if (!pyproxy_icmp_parse((void *)(long)skb->data, (void *)(long)skb->data_end, p, &e))
		return TC_ACT_OK;
	if (pyproxy_lb_icmp(&e, dir, &to) != PYPROXY_DNAT)
		return TC_ACT_OK;
	if (pyproxy_icmp_nat((void *)(long)skb->data, (void *)(long)skb->data_end, &e,
			     dir == PYPROXY_CT_REVERSE ? PYPROXY_NAT_DST : PYPROXY_NAT_SRC, to.addr, to.port))
		return TC_ACT_SHOT;
	if (dir == PYPROXY_CT_FORWARD)
		pyproxy_tc_mark(skb);
	return TC_ACT_OK;
}

SEC("tc")
int pyproxy_tc_ingress(struct __sk_buff *skb)
{
	struct pyproxy_pkt p;
	struct pyproxy_backend be;

	if (pyproxy_tc_translated(skb))
		return TC_ACT_OK;
	switch (pyproxy_tc_parse(skb, &p)) {
	case PYPROXY_PARSE_OK:
		break;
	case PYPROXY_PARSE_ICMP:
		return pyproxy_tc_icmp(skb, &p, PYPROXY_CT_FORWARD);
	default:
		if (pyproxy_is_ipv6((void *)(long)skb->data, (void *)(long)skb->data_end))
			bpf_tail_call(skb, &PYPROXY_MAP_JUMP6, PYPROXY_JUMP6_TC_INGRESS);
		return TC_ACT_OK;
	}
	switch (pyproxy_lb_forward(skb, skb->ingress_ifindex, &p, skb->len, 1, &be)) {
	case PYPROXY_DNAT:
		pyproxy_frag_record(&p);
		if (pyproxy_tc_nat(skb, &p, PYPROXY_NAT_DST, be.addr, be.port))
			return TC_ACT_SHOT;
		pyproxy_tc_mark(skb);
		return TC_ACT_OK;
	case PYPROXY_REJECT:
		return pyproxy_tc_reject(skb, &p);
	case PYPROXY_DROP:
		return TC_ACT_SHOT;
	default:
		return TC_ACT_OK;
	}
}

SEC("tc")
int pyproxy_tc_egress(struct __sk_buff *skb)
{
	struct pyproxy_pkt p;
	struct pyproxy_backend fe;

	switch (pyproxy_tc_parse(skb, &p)) {
	case PYPROXY_PARSE_OK:
		break;
	case PYPROXY_PARSE_ICMP:
		return pyproxy_tc_icmp(skb, &p, PYPROXY_CT_REVERSE);
	default:
		if (pyproxy_is_ipv6((void *)(long)skb->data, (void *)(long)skb->data_end))
			bpf_tail_call(skb, &PYPROXY_MAP_JUMP6, PYPROXY_JUMP6_TC_EGRESS);
		return TC_ACT_OK;
	}
	if (pyproxy_lb_reverse(&p, &fe) != PYPROXY_DNAT)
		return TC_ACT_OK;
	pyproxy_frag_record(&p);
	if (pyproxy_tc_nat(skb, &p, PYPROXY_NAT_SRC, fe.addr, fe.port))
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}

/* The same forward decision at the driver, for --xdp-devices. Replies still leave through TC egress, and
 * packets whose checksum form XDP cannot tell are left to TC ingress. */
SEC("xdp")
int pyproxy_xdp_ingress(struct xdp_md *ctx)
{
	struct pyproxy_pkt p;
	struct pyproxy_backend be;

	/* Fragments and ICMP errors go on to TC, which handles them whole. */
	switch (pyproxy_parse((void *)(long)ctx->data, (void *)(long)ctx->data_end, &p)) {
	case PYPROXY_PARSE_OK:
		break;
	case PYPROXY_PARSE_SKIP:
		if (pyproxy_is_ipv6((void *)(long)ctx->data, (void *)(long)ctx->data_end))
			bpf_tail_call(ctx, &PYPROXY_MAP_XJUMP6, PYPROXY_JUMP6_XDP);
		return XDP_PASS;
	default:
		return XDP_PASS;
	}
	if (p.frag)
		return XDP_PASS;
	/* Decided before the load balancer runs: TC ingress then makes the whole decision for this packet. */
	if (pyproxy_xdp_csum_ambiguous(ctx, &p))
		return XDP_PASS;
	switch (pyproxy_lb_forward(ctx, ctx->ingress_ifindex, &p, ctx->data_end - ctx->data, 0, &be)) {
	case PYPROXY_DNAT:
		/* Only a SYN or a datagram could look like a direct connection to TC (pyproxy_ct_untrack); a
		 * segment of an established flow needs no mark. No room for it: TC translates instead, following
		 * the flow just recorded. */
		if ((p.proto == IPPROTO_UDP || pyproxy_is_syn(&p)) && pyproxy_xdp_reserve_mark(ctx))
			return XDP_PASS;
		if (pyproxy_xdp_nat(ctx, &p, PYPROXY_NAT_DST, be.addr, be.port))
			return XDP_DROP;
		if (p.proto == IPPROTO_UDP || pyproxy_is_syn(&p))
			pyproxy_xdp_mark(ctx);
		return XDP_PASS;
	case PYPROXY_REJECT:
		return XDP_PASS;   /* TC ingress makes the answer */
	case PYPROXY_DROP:
		return XDP_DROP;
	default:
		return XDP_PASS;
	}
}

/* The IPv6 twins, reached by tail call from the entry points above (or attached on their own: they check the
 * frame themselves). */

/* parse6 for an skb: pulls once, and gives a later fragment its ports from its first fragment's record. */
static __always_inline int pyproxy_tc_parse6(struct __sk_buff *skb, struct pyproxy_pkt6 *p)
{
	int r = pyproxy_parse6((void *)(long)skb->data, (void *)(long)skb->data_end, p);

	if (r == PYPROXY_PARSE_SHORT && skb->len > skb->data_end - skb->data) {
		__u32 want = skb->len < 256 ? skb->len : 256;

		if (bpf_skb_pull_data(skb, want))
			return PYPROXY_PARSE_SKIP;
		r = pyproxy_parse6((void *)(long)skb->data, (void *)(long)skb->data_end, p);
	}
	if (r == PYPROXY_PARSE_FRAG)
		r = pyproxy_frag6_ports(p) ? PYPROXY_PARSE_OK : PYPROXY_PARSE_SKIP;
	return r;
}

/* An ICMPv6 error about a translated flow gets the quote its receiver knows (icmp6.h; `dir` as pyproxy_tc_icmp's). */
static __always_inline int pyproxy_tc_icmp6(struct __sk_buff *skb, const struct pyproxy_pkt6 *p, __u8 dir)
{
	struct pyproxy_icmp6_err e;
	struct pyproxy_backend6 to;
	__u32 want = skb->len < PYPROXY_ICMP6_PULL ? skb->len : PYPROXY_ICMP6_PULL;

	if (bpf_skb_pull_data(skb, want))
		return TC_ACT_OK;
	if (!pyproxy_icmp6_parse((void *)(long)skb->data, (void *)(long)skb->data_end, p, &e))
		return TC_ACT_OK;
	if (pyproxy_lb6_icmp(&e.saddr, &e.daddr, e.sport, e.dport, e.proto, dir, &to) != PYPROXY_DNAT)
		return TC_ACT_OK;
	if (pyproxy_icmp6_nat((void *)(long)skb->data, (void *)(long)skb->data_end, &e,
			      dir == PYPROXY_CT_REVERSE ? PYPROXY_NAT_DST : PYPROXY_NAT_SRC, &to))
		return TC_ACT_SHOT;
	if (dir == PYPROXY_CT_FORWARD)
		pyproxy_tc_mark(skb);
	return TC_ACT_OK;
}

SEC("tc")
int pyproxy_tc_ingress6(struct __sk_buff *skb)
{
	struct pyproxy_pkt6 p;
	struct pyproxy_backend6 be;

	if (pyproxy_tc_translated(skb))
		return TC_ACT_OK;
	switch (pyproxy_tc_parse6(skb, &p)) {
	case PYPROXY_PARSE_OK:
		break;
	case PYPROXY_PARSE_ICMP:
		return pyproxy_tc_icmp6(skb, &p, PYPROXY_CT_FORWARD);
	default:
		return TC_ACT_OK;
	}
	switch (pyproxy_lb6_forward(skb, skb->ingress_ifindex, &p, skb->len, 1, &be)) {
	case PYPROXY_DNAT:
		pyproxy_frag6_record(&p);
		if (pyproxy_tc_nat6(skb, &p, PYPROXY_NAT_DST, &be.addr, be.port))
			return TC_ACT_SHOT;
		pyproxy_tc_mark(skb);
		return TC_ACT_OK;
	case PYPROXY_REJECT:
		return pyproxy_tc_reject6(skb, &p);
	case PYPROXY_DROP:
		return TC_ACT_SHOT;
	default:
		return TC_ACT_OK;
	}
}

SEC("tc")
int pyproxy_tc_egress6(struct __sk_buff *skb)
{
	struct pyproxy_pkt6 p;
	struct pyproxy_backend6 fe;

	switch (pyproxy_tc_parse6(skb, &p)) {
	case PYPROXY_PARSE_OK:
		break;
	case PYPROXY_PARSE_ICMP:
		return pyproxy_tc_icmp6(skb, &p, PYPROXY_CT_REVERSE);
	default:
		return TC_ACT_OK;
	}
	if (pyproxy_lb6_reverse(&p, &fe) != PYPROXY_DNAT)
		return TC_ACT_OK;
	pyproxy_frag6_record(&p);
	if (pyproxy_tc_nat6(skb, &p, PYPROXY_NAT_SRC, &fe.addr, fe.port))
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}

SEC("xdp")
int pyproxy_xdp_ingress6(struct xdp_md *ctx)
{
	struct pyproxy_pkt6 p;
	struct pyproxy_backend6 be;

	/* Extension headers and fragments go on to TC, which handles them whole: XDP takes the plain packets, which
	 * is also what keeps its verification small (each way through the extension headers would be another). */
	if (pyproxy_parse6((void *)(long)ctx->data, (void *)(long)ctx->data_end, &p) != PYPROXY_PARSE_OK ||
	    p.l4_off != PYPROXY_IPV6_PLAIN)
		return XDP_PASS;
	if (pyproxy_xdp_csum_ambiguous6(ctx, &p))
		return XDP_PASS;
	switch (pyproxy_lb6_forward(ctx, ctx->ingress_ifindex, &p, ctx->data_end - ctx->data, 0, &be)) {
	case PYPROXY_DNAT:
		if ((p.proto == IPPROTO_UDP || pyproxy_is_syn6(&p)) && pyproxy_xdp_reserve_mark(ctx))
			return XDP_PASS;
		if (pyproxy_xdp_nat6(ctx, &p, PYPROXY_NAT_DST, &be.addr, be.port))
			return XDP_DROP;
		if (p.proto == IPPROTO_UDP || pyproxy_is_syn6(&p))
			pyproxy_xdp_mark(ctx);
		return XDP_PASS;
	case PYPROXY_REJECT:
		return XDP_PASS;
	case PYPROXY_DROP:
		return XDP_DROP;
	default:
		return XDP_PASS;
	}
}

/* Socket load balancing for the processes below the cgroup they are attached to, by default the root of the cgroup
 * tree: the node's own and its pods' (sock.h). */
SEC("cgroup/connect4")
int pyproxy_connect4(struct bpf_sock_addr *ctx)
{
	if (ctx->protocol != IPPROTO_TCP && ctx->protocol != IPPROTO_UDP)
		return PYPROXY_SOCK_OK;
	return pyproxy_sock_forward(ctx, ctx->protocol, 1);
}

SEC("cgroup/sendmsg4")
int pyproxy_sendmsg4(struct bpf_sock_addr *ctx)
{
	return pyproxy_sock_forward(ctx, IPPROTO_UDP, 0);
}

SEC("cgroup/recvmsg4")
int pyproxy_recvmsg4(struct bpf_sock_addr *ctx)
{
	return pyproxy_sock_reverse(ctx, 1);
}

SEC("cgroup/getpeername4")
int pyproxy_getpeer4(struct bpf_sock_addr *ctx)
{
	return pyproxy_sock_reverse(ctx, 0);
}

SEC("cgroup/connect6")
int pyproxy_connect6(struct bpf_sock_addr *ctx)
{
	if (ctx->protocol != IPPROTO_TCP && ctx->protocol != IPPROTO_UDP)
		return PYPROXY_SOCK_OK;
	return pyproxy_sock6_forward(ctx, ctx->protocol, 1);
}

SEC("cgroup/sendmsg6")
int pyproxy_sendmsg6(struct bpf_sock_addr *ctx)
{
	return pyproxy_sock6_forward(ctx, IPPROTO_UDP, 0);
}

SEC("cgroup/recvmsg6")
int pyproxy_recvmsg6(struct bpf_sock_addr *ctx)
{
	return pyproxy_sock6_reverse(ctx, 1);
}

SEC("cgroup/getpeername6")
int pyproxy_getpeer6(struct bpf_sock_addr *ctx)
{
	return pyproxy_sock6_reverse(ctx, 0);
}

SEC("cgroup/sock_release")
int pyproxy_release(struct bpf_sock *ctx)
{
	return pyproxy_sock_release(ctx);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
