/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Socket load balancing: the node's own processes (kubelet probes, host-network pods, a shell on the node)
 * reach frontends without any per-packet NAT. cgroup hooks at connect() and at each unconnected UDP send
 * choose the backend once and point the socket at it; their packets then leave as ordinary traffic to the
 * backend, which TC does not touch. For the application the socket still talks to the frontend: getpeername()
 * and the source of received datagrams are rewritten back (PYPROXY_MAP_SOCKS). The same frontends, backends
 * and ClientIP affinity as the packet path (lb.h), but that an externalTrafficPolicy Local frontend serves the
 * node from every endpoint (its PYPROXY_SVC_SCOPE_NODE entry); the node counts as one client for affinity
 * (source 0).
 */
#ifndef PYPROXY_SOCK_H
#define PYPROXY_SOCK_H

#include <linux/bpf.h>
#include <linux/errno.h>
#include <bpf/bpf_helpers.h>
#include "pyproxy/lb.h"
#include "pyproxy/lb6.h"

/* What a hook returns: 1 lets the call go on (possibly to a rewritten address), 0 fails it with the error set
 * by bpf_set_retval(). */
#define PYPROXY_SOCK_OK     1
#define PYPROXY_SOCK_REFUSE 0

/* A frontend without endpoints, both families: the call fails. */
static __always_inline int pyproxy_sock_refuse(const struct pyproxy_svc_value *svc)
{
	pyproxy_count(PYPROXY_CNT_SOCK_REFUSED);
	/* F_DROP (internalTrafficPolicy Local, no endpoint on this node while the cluster has some): the packet path
	 * drops, so the node's own connect fails as a dropped SYN ends, with ETIMEDOUT, though at once: there is no
	 * packet here to drop, and one let through untranslated would leave by the default route with the ClusterIP as
	 * its destination. Else refused, as REJECT answers. */
	bpf_set_retval(svc->flags & PYPROXY_SVC_F_DROP ? -ETIMEDOUT : -ECONNREFUSED);
	return PYPROXY_SOCK_REFUSE;
}

/* A node socket's connect() or sendmsg() to ctx's address: points it at a backend when that address is a
 * frontend. */
static __always_inline int pyproxy_sock_forward(struct bpf_sock_addr *ctx, __u8 proto)
{
	struct pyproxy_pkt p = { .daddr = ctx->user_ip4, .dport = (__be16)ctx->user_port, .proto = proto };
	struct pyproxy_svc_value *svc = pyproxy_frontend_of(&p);
	struct pyproxy_backend be, fe = { .addr = p.daddr, .port = p.dport };
	struct pyproxy_sock_key k = {};
	__u64 now;

	if (!svc)
		return PYPROXY_SOCK_OK;
	/* externalTrafficPolicy Local: the node's processes reach every endpoint, not only this node's. */
	if (svc->flags & PYPROXY_SVC_F_NODE_VIEW) {
		struct pyproxy_svc_value *node = pyproxy_frontend_in(&p, PYPROXY_SVC_SCOPE_NODE);

		if (node)   /* else mid-update: this node's endpoints serve */
			svc = node;
	}
	if (svc->backend_count == 0)
		return pyproxy_sock_refuse(svc);
	now = pyproxy_now();
	k.cookie = bpf_get_socket_cookie(ctx);
	/* A socket has no source port yet at connect(): Maglev hashes the socket instead, so the node's sockets
	 * spread over the backends (sh and dh see the node as one client, as affinity does). */
	if (svc->sched == PYPROXY_SCHED_MAGLEV)
		p.sport = (__be16)k.cookie;
	if (!((svc->flags & PYPROXY_SVC_F_AFFINITY) && pyproxy_affinity_lookup(&p, svc, now, &be))) {
		if (!pyproxy_pick_backend(&p, svc, &be)) {
			pyproxy_count(PYPROXY_CNT_SLOT_MISS);
			bpf_set_retval(-ECONNREFUSED);
			return PYPROXY_SOCK_REFUSE;
		}
	}
	if (svc->flags & PYPROXY_SVC_F_AFFINITY)
		pyproxy_affinity_record(&p, &be, svc->svc_id, now);
	k.addr = be.addr;
	k.port = be.port;
	bpf_map_update_elem(&PYPROXY_MAP_SOCKS, &k, &fe, BPF_ANY);
	ctx->user_ip4 = be.addr;
	ctx->user_port = be.port;
	pyproxy_count(PYPROXY_CNT_SOCK_LB);
	pyproxy_count_svc(svc->svc_id, 0);
	pyproxy_count_endpoint(&be, 0);
	return PYPROXY_SOCK_OK;
}

/* getpeername() of, or a datagram received by, a socket the hooks pointed at a backend: the frontend again. */
static __always_inline int pyproxy_sock_reverse(struct bpf_sock_addr *ctx)
{
	struct pyproxy_sock_key k = {
		.cookie = bpf_get_socket_cookie(ctx), .addr = ctx->user_ip4, .port = (__be16)ctx->user_port,
	};
	struct pyproxy_backend *fe = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKS, &k);

	if (fe) {
		ctx->user_ip4 = fe->addr;
		ctx->user_port = fe->port;
	}
	return PYPROXY_SOCK_OK;
}

/* The IPv6 twins (cgroup/connect6, sendmsg6, recvmsg6, getpeername6): the same decisions on the IPv6 maps
 * (lb6.h). An IPv4-mapped address (::ffff:a.b.c.d, a dual-stack socket reaching an IPv4 frontend) is no IPv6
 * frontend and is left alone: not balanced, as before these hooks existed (README). */
static __always_inline void pyproxy_sock6_addr(const struct bpf_sock_addr *ctx, struct pyproxy_in6 *a)
{
	a->w[0] = ctx->user_ip6[0];
	a->w[1] = ctx->user_ip6[1];
	a->w[2] = ctx->user_ip6[2];
	a->w[3] = ctx->user_ip6[3];
}

static __always_inline void pyproxy_sock6_set(struct bpf_sock_addr *ctx, const struct pyproxy_in6 *a, __be16 port)
{
	ctx->user_ip6[0] = a->w[0];
	ctx->user_ip6[1] = a->w[1];
	ctx->user_ip6[2] = a->w[2];
	ctx->user_ip6[3] = a->w[3];
	ctx->user_port = port;
}

static __always_inline int pyproxy_sock6_forward(struct bpf_sock_addr *ctx, __u8 proto)
{
	struct pyproxy_pkt6 p = { .dport = (__be16)ctx->user_port, .proto = proto };
	struct pyproxy_svc_value *svc;
	struct pyproxy_backend6 be, fe;
	struct pyproxy_sock6_key k = {};
	__u64 now;

	pyproxy_sock6_addr(ctx, &p.daddr);
	svc = pyproxy_lb6_frontend_of(&p);
	if (!svc)
		return PYPROXY_SOCK_OK;
	if (svc->flags & PYPROXY_SVC_F_NODE_VIEW) {
		struct pyproxy_svc_value *node = pyproxy_lb6_frontend_in(&p.daddr, p.dport, proto, PYPROXY_SVC_SCOPE_NODE);

		if (node)
			svc = node;
	}
	if (svc->backend_count == 0)
		return pyproxy_sock_refuse(svc);
	now = pyproxy_now();
	k.cookie = bpf_get_socket_cookie(ctx);
	if (svc->sched == PYPROXY_SCHED_MAGLEV)
		p.sport = (__be16)k.cookie;
	if (!((svc->flags & PYPROXY_SVC_F_AFFINITY) && pyproxy_lb6_affinity_lookup(&p, svc, now, &be))) {
		if (!pyproxy_lb6_pick_backend(&p, svc, &be)) {
			pyproxy_count(PYPROXY_CNT_SLOT_MISS);
			bpf_set_retval(-ECONNREFUSED);
			return PYPROXY_SOCK_REFUSE;
		}
	}
	if (svc->flags & PYPROXY_SVC_F_AFFINITY)
		pyproxy_lb6_affinity_record(&p, &be, svc->svc_id, now);
	k.addr = be.addr;
	k.port = be.port;
	fe.addr = p.daddr;
	fe.port = p.dport;
	fe.pad = 0;
	bpf_map_update_elem(&PYPROXY_MAP_SOCKS6, &k, &fe, BPF_ANY);
	pyproxy_sock6_set(ctx, &be.addr, be.port);
	pyproxy_count(PYPROXY_CNT_SOCK_LB);
	pyproxy_count_svc(svc->svc_id, 0);
	return PYPROXY_SOCK_OK;
}

static __always_inline int pyproxy_sock6_reverse(struct bpf_sock_addr *ctx)
{
	struct pyproxy_sock6_key k = { .cookie = bpf_get_socket_cookie(ctx), .port = (__be16)ctx->user_port };
	struct pyproxy_backend6 *fe;

	pyproxy_sock6_addr(ctx, &k.addr);
	fe = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKS6, &k);
	if (fe)
		pyproxy_sock6_set(ctx, &fe->addr, fe->port);
	return PYPROXY_SOCK_OK;
}

#endif
