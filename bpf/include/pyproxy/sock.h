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

/* What a hook returns: 1 lets the call go on (possibly to a rewritten address), 0 fails it with the error set
 * by bpf_set_retval(). */
#define PYPROXY_SOCK_OK     1
#define PYPROXY_SOCK_REFUSE 0

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
	if (svc->backend_count == 0) {
		pyproxy_count(PYPROXY_CNT_SOCK_REFUSED);
		/* F_DROP (internalTrafficPolicy Local, no endpoint on this node while the cluster has some): the
		 * packet path drops, so the node's own connect fails as a dropped SYN ends, with ETIMEDOUT, though at
		 * once: there is no packet here to drop, and one let through untranslated would leave by the default
		 * route with the ClusterIP as its destination. Else refused, as REJECT answers. */
		bpf_set_retval(svc->flags & PYPROXY_SVC_F_DROP ? -ETIMEDOUT : -ECONNREFUSED);
		return PYPROXY_SOCK_REFUSE;
	}
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

#endif
