/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Socket load balancing: processes below the hooked cgroup (the node's own: kubelet probes, host-network pods, a
 * shell on the node; and on a real node every pod, whose containers live below the root cgroup) reach frontends
 * without any per-packet NAT. cgroup hooks at connect() and at each unconnected UDP send choose the backend once
 * and point the socket at it; their packets then leave as ordinary traffic to the backend, which TC does not touch.
 * For the application the socket still talks to the frontend: getpeername() and the source of received datagrams
 * are rewritten back (pyproxy_sock_remember). The same frontends, backends and ClientIP affinity as the packet path
 * (lb.h), but that an externalTrafficPolicy Local frontend serves the node and its pods from every endpoint (its
 * PYPROXY_SVC_SCOPE_NODE entry, upstream's short circuit), and that the node's processes also reach NodePorts on
 * 127.0.0.1 (upstream's localhostNodePorts: PYPROXY_SVC_SCOPE_HOST entries, which only these hooks look up).
 *
 * Who the client is (pyproxy_sock_client): the caller's network namespace. The node's own namespace is one client,
 * source 0, as it always was; a pod (any other namespace) is its own client, keyed by its namespace cookie, so
 * ClientIP affinity and sh tell pods apart as upstream does by their addresses. A pod's call is translated here
 * only where the frontend says the result is the packet path's (PYPROXY_SVC_F_SOCK_PODS, decided by the model),
 * its connect() does not reach the pod itself (pyproxy_sock_hairpin) and --bpf-socket-lb-hostns-only is off; else
 * it goes on untouched and TC on the pod's veth translates its packets. The node's own calls have no packet path to
 * fall back on: a frontend whose source ranges leave the node out refuses them (PYPROXY_SVC_F_NODE_DENIED).
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

/* The client key of a pod for affinity and sh: its network namespace cookie in 0.0.0.0/8, which no packet's source
 * holds, so an entry never meets a TC flow's; 0 stays the node's. Two pods share a key only 2^24 - 1 namespaces
 * apart. */
static __always_inline __be32 pyproxy_sock_pod_key(__u64 netns)
{
	return bpf_htonl((__u32)(netns % 0xffffffULL) + 1);
}

/* What pyproxy_sock_client says of a call. */
enum pyproxy_sock_client_is {
	PYPROXY_SOCK_FOR_TC = 0,     /* a pod's call the hooks leave untouched */
	PYPROXY_SOCK_CLIENT,         /* translate it: *key is the client */
	PYPROXY_SOCK_DENIED,         /* the node's call, refused: its source ranges leave the node out */
};

/* Whether the hooks may translate the caller's call to a frontend of these flags: the node's own namespace (*key 0)
 * unless the frontend's source ranges leave it out (which the node's packets would meet on the packet path, as
 * upstream's); a pod's (*key its pod key) only where the frontend allows it and --bpf-socket-lb-hostns-only is off. */
static __always_inline int pyproxy_sock_client(struct bpf_sock_addr *ctx, __u16 flags, __be32 *key)
{
	__u64 netns = bpf_get_netns_cookie(ctx);

	if (netns == pyproxy_config.host_netns) {
		*key = 0;
		if (flags & PYPROXY_SVC_F_NODE_DENIED) {
			/* Dropped on the packet path: the connect fails as a dropped SYN ends, though at once. */
			pyproxy_count(PYPROXY_CNT_SOURCE_DENIED);
			bpf_set_retval(-ETIMEDOUT);
			return PYPROXY_SOCK_DENIED;
		}
		return PYPROXY_SOCK_CLIENT;
	}
	if (pyproxy_config.sock_hostns_only || !(flags & PYPROXY_SVC_F_SOCK_PODS))
		return PYPROXY_SOCK_FOR_TC;
	*key = pyproxy_sock_pod_key(netns);
	return PYPROXY_SOCK_CLIENT;
}

/* Hairpin: whether a pod's connect() to a frontend would reach the pod itself, its backend an address of the pod's
 * own namespace. TC masquerades such a flow (lb.h) so that the pod does not get a packet from its own address; here
 * the pod would reach itself from its own address. So it is left to TC, with the choice (pyproxy_hairpin_claim).
 * A bind to the address is the test (it succeeds only for a local one; with port 0 it takes no port): after one
 * that succeeds the socket is bound to the pod's own address, the source its route to itself gives; one that fails
 * changes nothing. `in6`: an IPv6 socket, `a` its backend (IPv4-mapped for an IPv4 one). Not asked for sendmsg()
 * (bpf_bind is a connect hook's), nor right for a pod with ip_nonlocal_bind or IP_FREEBIND (any bind succeeds: its
 * connect goes to TC, from that address), nor asked of a socket bound before its connect() (the bind fails: it is
 * translated). */
static __always_inline int pyproxy_sock_hairpin(struct bpf_sock_addr *ctx, const struct pyproxy_in6 *a, int in6)
{
	/* Written field by field: an initializer of constants would be a copy of one in .rodata, which holds the
	 * programs' constants only (loader.py checks its size). */
	if (in6) {
		struct sockaddr_in6 sa6;

		__builtin_memset(&sa6, 0, sizeof(sa6));
		sa6.sin6_family = AF_INET6;
		__builtin_memcpy(&sa6.sin6_addr, a, sizeof(*a));
		return bpf_bind(ctx, (struct sockaddr *)&sa6, sizeof(sa6)) == 0;
	}
	struct sockaddr_in sa;

	__builtin_memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_addr.s_addr = a->w[3];
	return bpf_bind(ctx, (struct sockaddr *)&sa, sizeof(sa)) == 0;
}

/* Unconnected UDP (sendmsg): one flow per socket and frontend, as the packet path has one per client port and the
 * kernel's conntrack one per 5-tuple, not a choice per datagram (a QUIC or statsd client would reach every endpoint
 * in turn). The backend the socket's earlier datagrams to the frontend went to (*be) while the flow lives: a
 * datagram either way within the UDP timeout (pyproxy_ct_timeouts.udp_new, 30 s; a stream's longer timeout is not
 * kept here), the frontend's Service the same and the backend still an endpoint (the epoch check of
 * pyproxy_ct_follow). Refreshed when followed; `epoch` read before the lookup. */
static __always_inline int pyproxy_sockflow_follow(const struct pyproxy_sock_key *k,
						   const struct pyproxy_svc_value *svc, __u32 epoch, __u64 now,
						   struct pyproxy_backend *be)
{
	struct pyproxy_sockflow_value *f = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKFLOWS, k);

	if (!f || f->svc_id != svc->svc_id || now - f->last_seen > pyproxy_config.ct.udp_new)
		return 0;
	*be = f->be;
	if (f->epoch != epoch) {
		if (!pyproxy_backend_alive(be))
			return 0;
		f->epoch = epoch;
	}
	f->last_seen = now;
	return 1;
}

/* A datagram from the backend of an unconnected socket's flow (recvmsg) keeps the flow as one to it does. */
static __always_inline void pyproxy_sockflow_answered(__u64 cookie, const struct pyproxy_sock_value *fe)
{
	struct pyproxy_sock_key k = { .cookie = cookie, .addr = fe->addr, .port = fe->port };
	struct pyproxy_sockflow_value *f = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKFLOWS, &k);

	if (f)
		f->last_seen = pyproxy_now();
}

/* What pyproxy_sock_choose made of a connect() or send. */
enum pyproxy_sock_choice {
	PYPROXY_SOCK_NOT_OURS = 0,   /* not a frontend: the call goes on untouched */
	PYPROXY_SOCK_CHOSEN,         /* *be is the backend */
	PYPROXY_SOCK_REFUSED,        /* the call fails (bpf_set_retval said how) */
};

/* The services map scope a socket's IPv4 destination is looked up in: a loopback address's NodePorts are HOST
 * entries (abi.h), every other frontend a PACKETS one. */
static __always_inline __u8 pyproxy_sock_scope(__be32 daddr)
{
	return (bpf_ntohl(daddr) >> 24) == 127 ? PYPROXY_SVC_SCOPE_HOST : PYPROXY_SVC_SCOPE_PACKETS;
}

/* The backend for a socket's connect() or send to the IPv4 frontend daddr:dport (its IPv4 hook's, or an IPv6
 * socket's IPv4-mapped destination); *cookie gets the socket's cookie when it is one. */
static __always_inline int pyproxy_sock_choose(struct bpf_sock_addr *ctx, __be32 daddr, __be16 dport, __u8 proto,
					       int connect, __u64 *cookie, struct pyproxy_backend *be, __u8 *sock_flags)
{
	struct pyproxy_pkt p = { .daddr = daddr, .dport = dport, .proto = proto };
	struct pyproxy_svc_value *svc = pyproxy_frontend_in(&p, pyproxy_sock_scope(daddr));
	struct pyproxy_sock_key flow;
	__u32 epoch;
	__u64 now;

	if (!svc)
		return PYPROXY_SOCK_NOT_OURS;
	/* externalTrafficPolicy Local: the node's processes and pods reach every endpoint, not only this node's. */
	switch (pyproxy_sock_client(ctx, svc->flags, &p.saddr)) {
	case PYPROXY_SOCK_FOR_TC:
		return PYPROXY_SOCK_NOT_OURS;
	case PYPROXY_SOCK_DENIED:
		return PYPROXY_SOCK_REFUSED;
	}
	if (svc->flags & PYPROXY_SVC_F_NODE_VIEW) {
		struct pyproxy_svc_value *node = pyproxy_frontend_in(&p, PYPROXY_SVC_SCOPE_NODE);

		if (node)   /* else mid-update: this node's endpoints serve */
			svc = node;
	}
	if (svc->backend_count == 0) {
		pyproxy_sock_refuse(svc);
		return PYPROXY_SOCK_REFUSED;
	}
	now = pyproxy_now();
	epoch = pyproxy_backends_epoch();
	*cookie = bpf_get_socket_cookie(ctx);
	flow = (struct pyproxy_sock_key){ .cookie = *cookie, .addr = daddr, .port = dport };
	/* A socket has no source port yet at connect(): Maglev hashes the socket instead, so one client's sockets
	 * spread over the backends (sh sees each pod, and the node, as one client, as affinity does). */
	if (svc->sched == PYPROXY_SCHED_MAGLEV)
		p.sport = (__be16)*cookie;
	if (connect || !pyproxy_sockflow_follow(&flow, svc, epoch, now, be)) {
		if (!((svc->flags & PYPROXY_SVC_F_AFFINITY) && pyproxy_affinity_lookup(&p, svc, now, be)) &&
		    !pyproxy_pick_backend(&p, svc, be)) {
			pyproxy_count(PYPROXY_CNT_SLOT_MISS);
			bpf_set_retval(-ECONNREFUSED);
			return PYPROXY_SOCK_REFUSED;
		}
		if (!connect) {
			struct pyproxy_sockflow_value f = { .be = *be, .svc_id = svc->svc_id, .epoch = epoch, .last_seen = now };

			bpf_map_update_elem(&PYPROXY_MAP_SOCKFLOWS, &flow, &f, BPF_ANY);
		}
	}
	/* Recorded first: a pod's affinity to itself keeps each connection of it on TC, whose own affinity holds. */
	if (svc->flags & PYPROXY_SVC_F_AFFINITY)
		pyproxy_affinity_record(&p, be, svc->svc_id, now);
	if (connect && p.saddr) {
		struct pyproxy_in6 a = { .w = { 0, 0, bpf_htonl(0xffff), be->addr } };

		if (pyproxy_sock_hairpin(ctx, &a, ctx->user_family == AF_INET6)) {
			pyproxy_hairpin_claim(daddr, dport, proto, be, svc->svc_id, now);
			return PYPROXY_SOCK_NOT_OURS;
		}
	}
	/* lc, sed and nq count the connection while its socket lives, as TC counts a flow while it lives. */
	*sock_flags = 0;
	if (connect && pyproxy_sched_counts(svc)) {
		pyproxy_active_add(be, 1);
		*sock_flags = PYPROXY_SOCK_F_COUNTED;
	}
	pyproxy_count(PYPROXY_CNT_SOCK_LB);
	pyproxy_count_svc(svc->svc_id, 0);
	pyproxy_count_endpoint(be, 0);
	return PYPROXY_SOCK_CHOSEN;
}

/* Where the frontend a socket asked for is kept, by (socket, backend): a connected socket's in PYPROXY_MAP_SOCKS,
 * which its close deletes; an unconnected socket's answers in PYPROXY_MAP_SOCKANS, which only the LRU ages. */
static __always_inline void pyproxy_sock_remember(const struct pyproxy_sock_key *k, const struct pyproxy_sock_value *fe,
						  int connect)
{
	if (connect)
		bpf_map_update_elem(&PYPROXY_MAP_SOCKS, k, fe, BPF_ANY);
	else
		bpf_map_update_elem(&PYPROXY_MAP_SOCKANS, k, fe, BPF_ANY);
}

/* The frontend for a connected socket's getpeername() or datagrams, or (`answer`) an unconnected one's datagrams. */
static __always_inline struct pyproxy_sock_value *pyproxy_sock_recall(const struct pyproxy_sock_key *k, int answer)
{
	struct pyproxy_sock_value *fe = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKS, k);

	if (!fe && answer)
		fe = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKANS, k);
	return fe;
}

/* A socket's connect() (`connect`) or sendmsg() to ctx's address: points it at a backend when that address is a
 * frontend. */
static __always_inline int pyproxy_sock_forward(struct bpf_sock_addr *ctx, __u8 proto, int connect)
{
	struct pyproxy_sock_value fe = { .addr = ctx->user_ip4, .port = (__be16)ctx->user_port };
	struct pyproxy_backend be;
	struct pyproxy_sock_key k = {};

	switch (pyproxy_sock_choose(ctx, fe.addr, fe.port, proto, connect, &k.cookie, &be, &fe.flags)) {
	case PYPROXY_SOCK_NOT_OURS:
		return PYPROXY_SOCK_OK;
	case PYPROXY_SOCK_REFUSED:
		return PYPROXY_SOCK_REFUSE;
	}
	k.addr = be.addr;
	k.port = be.port;
	pyproxy_sock_remember(&k, &fe, connect);
	ctx->user_ip4 = be.addr;
	ctx->user_port = be.port;
	return PYPROXY_SOCK_OK;
}

/* getpeername() of, or a datagram received by (`answer`), a socket the hooks pointed at a backend: the frontend
 * again. */
static __always_inline int pyproxy_sock_reverse(struct bpf_sock_addr *ctx, int answer)
{
	struct pyproxy_sock_key k = {
		.cookie = bpf_get_socket_cookie(ctx), .addr = ctx->user_ip4, .port = (__be16)ctx->user_port,
	};
	struct pyproxy_sock_value *fe = pyproxy_sock_recall(&k, answer);

	if (fe) {
		if (answer)
			pyproxy_sockflow_answered(k.cookie, fe);
		ctx->user_ip4 = fe->addr;
		ctx->user_port = fe->port;
	}
	return PYPROXY_SOCK_OK;
}

/* The IPv6 twins (cgroup/connect6, sendmsg6, recvmsg6, getpeername6): the same decisions on the IPv6 maps
 * (lb6.h). An IPv4-mapped destination (::ffff:a.b.c.d: an IPv6 socket reaching an IPv4 address) goes through the
 * IPv4 frontends, and gets its backend IPv4-mapped too. */
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

/* ::ffff:a.b.c.d */
static __always_inline int pyproxy_in6_v4mapped(const struct pyproxy_in6 *a)
{
	return a->w[0] == 0 && a->w[1] == 0 && a->w[2] == bpf_htonl(0xffff);
}

/* pyproxy_sock_remember's and pyproxy_sock_recall's twins, for IPv6 sockets. */
static __always_inline void pyproxy_sock6_remember(const struct pyproxy_sock6_key *k,
						   const struct pyproxy_sock6_value *fe, int connect)
{
	if (connect)
		bpf_map_update_elem(&PYPROXY_MAP_SOCKS6, k, fe, BPF_ANY);
	else
		bpf_map_update_elem(&PYPROXY_MAP_SOCKANS6, k, fe, BPF_ANY);
}

static __always_inline struct pyproxy_sock6_value *pyproxy_sock6_recall(const struct pyproxy_sock6_key *k, int answer)
{
	struct pyproxy_sock6_value *fe = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKS6, k);

	if (!fe && answer)
		fe = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKANS6, k);
	return fe;
}

/* An IPv6 socket's connect() or send to an IPv4-mapped address: the IPv4 frontends decide; the socket is pointed at
 * the IPv4-mapped backend, and PYPROXY_MAP_SOCKS6 remembers the IPv4-mapped frontend for its peer name. */
static __always_inline int pyproxy_sock6_forward_mapped(struct bpf_sock_addr *ctx, const struct pyproxy_in6 *daddr,
							__be16 dport, __u8 proto, int connect)
{
	struct pyproxy_backend be;
	struct pyproxy_sock6_value fe = { .addr = *daddr, .port = dport };
	struct pyproxy_sock6_key k = { .addr = *daddr };

	switch (pyproxy_sock_choose(ctx, daddr->w[3], dport, proto, connect, &k.cookie, &be, &fe.flags)) {
	case PYPROXY_SOCK_NOT_OURS:
		return PYPROXY_SOCK_OK;
	case PYPROXY_SOCK_REFUSED:
		return PYPROXY_SOCK_REFUSE;
	}
	k.addr.w[3] = be.addr;
	k.port = be.port;
	pyproxy_sock6_remember(&k, &fe, connect);
	pyproxy_sock6_set(ctx, &k.addr, be.port);
	return PYPROXY_SOCK_OK;
}

/* pyproxy_sockflow_follow's twin, for IPv6 frontends. */
static __always_inline int pyproxy_sockflow6_follow(const struct pyproxy_sock6_key *k,
						    const struct pyproxy_svc_value *svc, __u32 epoch, __u64 now,
						    struct pyproxy_backend6 *be)
{
	struct pyproxy_sockflow6_value *f = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKFLOWS6, k);

	if (!f || f->svc_id != svc->svc_id || now - f->last_seen > pyproxy_config.ct.udp_new)
		return 0;
	*be = f->be;
	if (f->epoch != epoch) {
		if (!pyproxy_lb6_backend_alive(be))
			return 0;
		f->epoch = epoch;
	}
	f->last_seen = now;
	return 1;
}

/* pyproxy_sockflow_answered's twin. */
static __always_inline void pyproxy_sockflow6_answered(__u64 cookie, const struct pyproxy_sock6_value *fe)
{
	struct pyproxy_sock6_key k = { .cookie = cookie, .addr = fe->addr, .port = fe->port };
	struct pyproxy_sockflow6_value *f = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKFLOWS6, &k);

	if (f)
		f->last_seen = pyproxy_now();
}

static __always_inline int pyproxy_sock6_forward(struct bpf_sock_addr *ctx, __u8 proto, int connect)
{
	struct pyproxy_pkt6 p = { .dport = (__be16)ctx->user_port, .proto = proto };
	struct pyproxy_svc_value *svc;
	struct pyproxy_backend6 be;
	struct pyproxy_sock6_value fe = {};
	struct pyproxy_sock6_key k = {};
	__u32 epoch;
	__u64 now;

	pyproxy_sock6_addr(ctx, &p.daddr);
	if (pyproxy_in6_v4mapped(&p.daddr))
		return pyproxy_sock6_forward_mapped(ctx, &p.daddr, p.dport, proto, connect);
	svc = pyproxy_lb6_frontend_of(&p);
	if (!svc)
		return PYPROXY_SOCK_OK;
	switch (pyproxy_sock_client(ctx, svc->flags, &p.saddr.w[3])) {
	case PYPROXY_SOCK_FOR_TC:
		return PYPROXY_SOCK_OK;
	case PYPROXY_SOCK_DENIED:
		return PYPROXY_SOCK_REFUSE;
	}
	if (svc->flags & PYPROXY_SVC_F_NODE_VIEW) {
		struct pyproxy_svc_value *node = pyproxy_lb6_frontend_in(&p.daddr, p.dport, proto, PYPROXY_SVC_SCOPE_NODE);

		if (node)
			svc = node;
	}
	if (svc->backend_count == 0)
		return pyproxy_sock_refuse(svc);
	now = pyproxy_now();
	epoch = pyproxy_backends_epoch();
	k.cookie = bpf_get_socket_cookie(ctx);
	if (svc->sched == PYPROXY_SCHED_MAGLEV)
		p.sport = (__be16)k.cookie;
	/* k holds the frontend for the flow's lookup and record, then the backend for pyproxy_sock6_remember. */
	k.addr = p.daddr;
	k.port = p.dport;
	if (connect || !pyproxy_sockflow6_follow(&k, svc, epoch, now, &be)) {
		if (!((svc->flags & PYPROXY_SVC_F_AFFINITY) && pyproxy_lb6_affinity_lookup(&p, svc, now, &be)) &&
		    !pyproxy_lb6_pick_backend(&p, svc, &be)) {
			pyproxy_count(PYPROXY_CNT_SLOT_MISS);
			bpf_set_retval(-ECONNREFUSED);
			return PYPROXY_SOCK_REFUSE;
		}
		if (!connect) {
			struct pyproxy_sockflow6_value f = { .be = be, .svc_id = svc->svc_id, .epoch = epoch, .last_seen = now };

			bpf_map_update_elem(&PYPROXY_MAP_SOCKFLOWS6, &k, &f, BPF_ANY);
		}
	}
	if (svc->flags & PYPROXY_SVC_F_AFFINITY)
		pyproxy_lb6_affinity_record(&p, &be, svc->svc_id, now);
	if (connect && p.saddr.w[3] && pyproxy_sock_hairpin(ctx, &be.addr, 1)) {
		pyproxy_lb6_hairpin_claim(&p.daddr, p.dport, proto, &be, svc->svc_id, now);
		return PYPROXY_SOCK_OK;
	}
	k.addr = be.addr;
	k.port = be.port;
	fe.addr = p.daddr;
	fe.port = p.dport;
	if (connect && pyproxy_sched_counts(svc)) {
		pyproxy_lb6_active_add(&be, 1);
		fe.flags = PYPROXY_SOCK_F_COUNTED;
	}
	pyproxy_sock6_remember(&k, &fe, connect);
	pyproxy_sock6_set(ctx, &be.addr, be.port);
	pyproxy_count(PYPROXY_CNT_SOCK_LB);
	pyproxy_count_svc(svc->svc_id, 0);
	pyproxy_count_endpoint6(&be, 0);
	return PYPROXY_SOCK_OK;
}

static __always_inline int pyproxy_sock6_reverse(struct bpf_sock_addr *ctx, int answer)
{
	struct pyproxy_sock6_key k = { .cookie = bpf_get_socket_cookie(ctx), .port = (__be16)ctx->user_port };
	struct pyproxy_sock6_value *fe;

	pyproxy_sock6_addr(ctx, &k.addr);
	fe = pyproxy_sock6_recall(&k, answer);
	if (fe) {
		if (answer)
			pyproxy_sockflow6_answered(k.cookie, fe);
		pyproxy_sock6_set(ctx, &fe->addr, fe->port);
	} else if (pyproxy_in6_v4mapped(&k.addr)) {
		/* An unconnected IPv6 socket's datagram to an IPv4-mapped address is sent by the IPv4 path, whose sendmsg4
		 * hook recorded it in PYPROXY_MAP_SOCKANS: the answer's source is looked up there. */
		struct pyproxy_sock_key k4 = { .cookie = k.cookie, .addr = k.addr.w[3], .port = k.port };
		struct pyproxy_sock_value *fe4 = pyproxy_sock_recall(&k4, answer);

		if (fe4) {
			if (answer)
				pyproxy_sockflow_answered(k.cookie, fe4);
			k.addr.w[3] = fe4->addr;
			pyproxy_sock6_set(ctx, &k.addr, fe4->port);
		}
	}
	return PYPROXY_SOCK_OK;
}

/* A socket's close (cgroup/sock_release, both families): the PYPROXY_MAP_SOCKS(6) entry of the backend it is
 * connected to goes, and the connection its connect() counted for lc, sed and nq with it. (An unconnected UDP
 * socket's entries, one per backend it sent to, are in PYPROXY_MAP_SOCKANS(6) and age out of that LRU.) */
static __always_inline void pyproxy_sock_forget(__u64 cookie, __be32 addr, __be16 port)
{
	struct pyproxy_sock_key k = { .cookie = cookie, .addr = addr, .port = port };
	struct pyproxy_sock_value *v = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKS, &k);
	struct pyproxy_backend be = { .addr = addr, .port = port };

	if (!v)
		return;
	if (v->flags & PYPROXY_SOCK_F_COUNTED)
		pyproxy_active_add(&be, -1);
	bpf_map_delete_elem(&PYPROXY_MAP_SOCKS, &k);
}

static __always_inline void pyproxy_sock6_forget(__u64 cookie, const struct bpf_sock *sk)
{
	struct pyproxy_sock6_key k = { .cookie = cookie, .port = (__be16)sk->dst_port };
	struct pyproxy_sock6_value *v;

	k.addr.w[0] = sk->dst_ip6[0];
	k.addr.w[1] = sk->dst_ip6[1];
	k.addr.w[2] = sk->dst_ip6[2];
	k.addr.w[3] = sk->dst_ip6[3];
	v = bpf_map_lookup_elem(&PYPROXY_MAP_SOCKS6, &k);
	if (!v)
		return;
	if (v->flags & PYPROXY_SOCK_F_COUNTED) {
		/* An IPv4-mapped backend is an IPv4 frontend's (pyproxy_sock6_forward_mapped): counted in the IPv4 map. */
		if (pyproxy_in6_v4mapped(&k.addr)) {
			struct pyproxy_backend be = { .addr = k.addr.w[3], .port = k.port };

			pyproxy_active_add(&be, -1);
		} else {
			struct pyproxy_backend6 be = { .addr = k.addr, .port = k.port };

			pyproxy_lb6_active_add(&be, -1);
		}
	}
	bpf_map_delete_elem(&PYPROXY_MAP_SOCKS6, &k);
}

static __always_inline int pyproxy_sock_release(struct bpf_sock *sk)
{
	__u64 cookie;

	if (sk->protocol != IPPROTO_TCP && sk->protocol != IPPROTO_UDP)
		return PYPROXY_SOCK_OK;
	cookie = bpf_get_socket_cookie(sk);
	if (sk->family == AF_INET)
		pyproxy_sock_forget(cookie, sk->dst_ip4, (__be16)sk->dst_port);
	else if (sk->family == AF_INET6)
		pyproxy_sock6_forget(cookie, sk);
	return PYPROXY_SOCK_OK;
}

#endif
