// SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0)
/*
 * The established-flow XDP path cut into cumulative steps, for the per-packet profile (bench/packet.py):
 * each program runs the steps of the one before it plus one more, composed from the same inline helpers
 * as bpf/pyproxy.bpf.c, so the difference between neighbours is what that step costs. The last step is
 * the production program itself (measured from bpf/build/pyproxy.bpf.o). Not shipped: the maps are
 * pyproxy's, reused from the loaded production object.
 *
 * Every program returns XDP_PASS only when its steps found what an established flow finds, so the
 * compiler can drop none of them and the benchmark can check that each step really ran.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "pyproxy/lb.h"
#include "pyproxy/nat.h"

static __always_inline int step_parse(struct xdp_md *ctx, struct pyproxy_pkt *p)
{
	return pyproxy_parse((void *)(long)ctx->data, (void *)(long)ctx->data_end, p) == PYPROXY_PARSE_OK &&
	       !pyproxy_xdp_csum_ambiguous(ctx, p);
}

/* Parse Ethernet/IPv4/TCP, and the XDP checksum-form check. */
SEC("xdp")
int step1_parse(struct xdp_md *ctx)
{
	struct pyproxy_pkt p;

	return step_parse(ctx, &p) ? XDP_PASS : XDP_DROP;
}

/* + the frontend lookup (the whole cost of a packet that is not to a Service). */
SEC("xdp")
int step2_frontend(struct xdp_md *ctx)
{
	struct pyproxy_pkt p;

	return step_parse(ctx, &p) && pyproxy_frontend_of(&p) ? XDP_PASS : XDP_DROP;
}

/* + the clock (jiffies: an inlined load) and the backends epoch (an array read). */
SEC("xdp")
int step3_clock(struct xdp_md *ctx)
{
	struct pyproxy_pkt p;

	return step_parse(ctx, &p) && pyproxy_frontend_of(&p) && pyproxy_now() && pyproxy_backends_epoch() != ~0U
	       ? XDP_PASS : XDP_DROP;
}

/* + the flow's connection-tracking lookup. */
SEC("xdp")
int step4_flow(struct xdp_md *ctx)
{
	struct pyproxy_pkt p;

	return step_parse(ctx, &p) && pyproxy_frontend_of(&p) && pyproxy_now() && pyproxy_backends_epoch() != ~0U &&
	       pyproxy_ct_lookup(&p, PYPROXY_CT_FORWARD) ? XDP_PASS : XDP_DROP;
}

/* + following the flow: live (idle within its state's timeout), not a new SYN, same frontend, and its backend
 * still an endpoint (an epoch compare; the lookup only after backends were removed). */
SEC("xdp")
int step5_backend(struct xdp_md *ctx)
{
	struct pyproxy_svc_value *svc;
	struct pyproxy_ct_value *ct;
	struct pyproxy_backend be;
	struct pyproxy_ct_key k;
	struct pyproxy_pkt p;
	__u32 epoch;
	__u64 now;

	if (!step_parse(ctx, &p) || !(svc = pyproxy_frontend_of(&p)) || !(now = pyproxy_now()))
		return XDP_DROP;
	epoch = pyproxy_backends_epoch();
	pyproxy_ct_key_of(&p, PYPROXY_CT_FORWARD, &k);
	ct = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &k);
	return ct && pyproxy_ct_live(&k, ct, now) && !pyproxy_is_syn(&p) && pyproxy_ct_follow(ct, svc, epoch, &be)
	       ? XDP_PASS : XDP_DROP;
}

/* + last_seen and state, and the two per-CPU counters: the whole load-balancing decision, without the rewrite. */
SEC("xdp")
int step6_decision(struct xdp_md *ctx)
{
	struct pyproxy_backend be;
	struct pyproxy_pkt p;

	if (!step_parse(ctx, &p))
		return XDP_DROP;
	return pyproxy_lb_forward(ctx, ctx->ingress_ifindex, &p, ctx->data_end - ctx->data, 0, &be) == PYPROXY_DNAT ? XDP_PASS : XDP_DROP;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
