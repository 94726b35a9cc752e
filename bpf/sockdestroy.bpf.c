// SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0)
/*
 * Moving a node process's connected UDP sockets off an endpoint that left (kernel 6.5 and newer: bpf_sock_destroy).
 *
 * The socket hooks (sock.h) point a connected socket at a backend once, at connect(); its datagrams then carry the
 * backend's own address, which no later choice can change, where the packet path's flow moves to another endpoint
 * at its next datagram (lb.h's epoch check). So after a sync that removed endpoints the control plane runs this
 * iterator over the UDP sockets of its network namespace (the node's): a socket the hooks pointed at a backend
 * (its PYPROXY_MAP_SOCKS(6) entry) that is no longer an endpoint (gone from PYPROXY_MAP_BACKENDS(6), the test TC
 * makes of a flow) is destroyed, as Cilium does. Its owner's next call fails with ECONNABORTED, and the socket it
 * opens then is balanced afresh. TCP needs none of this: its peer's reset or timeout ends such a connection.
 *
 * An object of its own: the kfunc is 6.5's, and the datapath object must load on 6.1. It has the datapath's maps
 * (maps.h) and is loaded on the datapath object's own (adopted, never created). Each destroyed socket writes its
 * cookie to the iterator's output, which the control plane counts.
 */
#include <linux/bpf.h>
#include <linux/in6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "pyproxy/maps.h"

#define AF_INET 2
#define AF_INET6 10

/* The kernel's types this program reads, with only the fields it reads: CO-RE relocates each access to the running
 * kernel's layout (its BTF), so no vmlinux.h is needed. */
struct sock_common {
	__be32 skc_daddr;
	__be16 skc_dport;
	unsigned short skc_family;
	struct in6_addr skc_v6_daddr;
} __attribute__((preserve_access_index));

struct udp_sock;
struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

struct bpf_iter__udp {
	struct bpf_iter_meta *meta;
	struct udp_sock *udp_sk;
} __attribute__((preserve_access_index));

extern int bpf_sock_destroy(struct sock_common *sk) __ksym;

/* Whether the IPv4 socket `sk` is one the hooks pointed at a backend that is no longer an endpoint. */
static __always_inline int pyproxy_sock_stale(struct sock_common *sk, __u64 cookie)
{
	struct pyproxy_sock_key k = { .cookie = cookie, .addr = sk->skc_daddr, .port = sk->skc_dport };
	struct pyproxy_backend be = { .addr = k.addr, .port = k.port };

	return bpf_map_lookup_elem(&PYPROXY_MAP_SOCKS, &k) && !bpf_map_lookup_elem(&PYPROXY_MAP_BACKENDS, &be);
}

/* Its twin for an IPv6 socket; an IPv4-mapped backend is an IPv4 frontend's (sock.h), an endpoint of the IPv4 maps. */
static __always_inline int pyproxy_sock6_stale(struct sock_common *sk, __u64 cookie)
{
	struct pyproxy_sock6_key k = { .cookie = cookie, .port = sk->skc_dport };

	k.addr.w[0] = sk->skc_v6_daddr.in6_u.u6_addr32[0];
	k.addr.w[1] = sk->skc_v6_daddr.in6_u.u6_addr32[1];
	k.addr.w[2] = sk->skc_v6_daddr.in6_u.u6_addr32[2];
	k.addr.w[3] = sk->skc_v6_daddr.in6_u.u6_addr32[3];
	if (!bpf_map_lookup_elem(&PYPROXY_MAP_SOCKS6, &k))
		return 0;
	if (k.addr.w[0] == 0 && k.addr.w[1] == 0 && k.addr.w[2] == bpf_htonl(0xffff)) {
		struct pyproxy_backend be = { .addr = k.addr.w[3], .port = k.port };

		return !bpf_map_lookup_elem(&PYPROXY_MAP_BACKENDS, &be);
	}
	struct pyproxy_backend6 be6 = { .addr = k.addr, .port = k.port };

	return !bpf_map_lookup_elem(&PYPROXY_MAP_BACKENDS6, &be6);
}

SEC("iter/udp")
int pyproxy_udp_destroy(struct bpf_iter__udp *ctx)
{
	struct sock_common *sk = (struct sock_common *)ctx->udp_sk;
	__u64 cookie;
	int stale;

	if (!sk)
		return 0;
	cookie = bpf_get_socket_cookie(sk);
	if (sk->skc_family == AF_INET)
		stale = pyproxy_sock_stale(sk, cookie);
	else if (sk->skc_family == AF_INET6)
		stale = pyproxy_sock6_stale(sk, cookie);
	else
		return 0;
	if (stale && bpf_sock_destroy(sk) == 0)
		bpf_seq_write(ctx->meta->seq, &cookie, sizeof(cookie));
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
