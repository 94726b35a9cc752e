/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * maps.h for BCC (--bpf-loader=bcc, pyproxy/dataplane/bpf/bcc.py): the same maps, names, layouts (abi.h) and
 * constants, in the form BCC 0.26 compiles. BCC's frontend knows neither libbpf's BTF map definitions (SEC(".maps"))
 * nor .rodata, and its rewriter turns only `table.lookup(&k)` calls into map references: a plain
 * bpf_map_lookup_elem(&map, &k), as every source here writes it, is left with an unresolved relocation (the
 * verifier then sees a null map pointer). So BCC compiles bpf/ twice, in one process:
 *
 *  1. PYPROXY_BCC_TABLES: only the table declarations below. BCC creates each map, or opens its pin when it is
 *     there (BPF_TABLE_PINNED's "type:path" section), and pins the ones it created. The loader then checks every
 *     map's shape against what the declaration asked (a pin of another shape is replaced, as libbpf's loader does).
 *  2. The programs, with each map's fd from step 1 passed as -Dpyproxy_ct_v3=... (map name -> PYPROXY_BCC_MAP(fd)):
 *     &PYPROXY_MAP_CT is then bpf_pseudo_fd(1, fd), the very instruction BCC's rewriter would have made.
 *
 * The declarations mirror maps.h's one for one (type, key, value, capacity, flags); tests/priv/test_bcc.py
 * checks that both loaders make the same maps.
 */
#ifndef PYPROXY_BCC_H
#define PYPROXY_BCC_H

#include "pyproxy/abi.h"

#define BPF_LICENSE Dual BSD/GPL

#define PYPROXY_BCC_STR_(x) #x
#define PYPROXY_BCC_STR(x) PYPROXY_BCC_STR_(x)

#ifdef PYPROXY_BCC_TABLES

/* -DPYPROXY_BCC_PIN_DIR="/sys/fs/bpf/pyproxy": pinned there, as libbpf's LIBBPF_PIN_BY_NAME pins by map name. */
#ifdef PYPROXY_BCC_PIN_DIR
#define PYPROXY_BCC_TABLE(type, key, value, name, max, flags) \
	BPF_F_TABLE(type ":" PYPROXY_BCC_PIN_DIR "/" PYPROXY_BCC_STR(name), key, value, name, max, flags)
#else
#define PYPROXY_BCC_TABLE(type, key, value, name, max, flags) BPF_F_TABLE(type, key, value, name, max, flags)
#endif

/* Capacities: -DPYPROXY_BCC_MAX_<short name>=n (abi.RESIZABLE's short names) does what bpf_map__set_max_entries
 * does for libbpf; the default is abi.h's. */
#ifndef PYPROXY_BCC_MAX_services
#define PYPROXY_BCC_MAX_services PYPROXY_MAX_SERVICES
#endif
#ifndef PYPROXY_BCC_MAX_slots
#define PYPROXY_BCC_MAX_slots PYPROXY_MAX_SLOTS
#endif
#ifndef PYPROXY_BCC_MAX_backends
#define PYPROXY_BCC_MAX_backends PYPROXY_MAX_BACKENDS
#endif
#ifndef PYPROXY_BCC_MAX_ct
#define PYPROXY_BCC_MAX_ct PYPROXY_MAX_FLOWS
#endif
#ifndef PYPROXY_BCC_MAX_stats
#define PYPROXY_BCC_MAX_stats PYPROXY_MAX_SERVICES
#endif
#ifndef PYPROXY_BCC_MAX_names
#define PYPROXY_BCC_MAX_names PYPROXY_MAX_SERVICES
#endif
#ifndef PYPROXY_BCC_MAX_frags
#define PYPROXY_BCC_MAX_frags PYPROXY_MAX_FRAGS
#endif
#ifndef PYPROXY_BCC_MAX_socks
#define PYPROXY_BCC_MAX_socks PYPROXY_MAX_SOCKS
#endif
#ifndef PYPROXY_BCC_MAX_sockflows
#define PYPROXY_BCC_MAX_sockflows PYPROXY_MAX_SOCKS
#endif
#ifndef PYPROXY_BCC_MAX_sockanswers
#define PYPROXY_BCC_MAX_sockanswers PYPROXY_MAX_SOCKS
#endif
#ifndef PYPROXY_BCC_MAX_srcranges
#define PYPROXY_BCC_MAX_srcranges PYPROXY_MAX_SRCRANGES
#endif
#ifndef PYPROXY_BCC_MAX_cursors
#define PYPROXY_BCC_MAX_cursors PYPROXY_MAX_SERVICES
#endif
#ifndef PYPROXY_BCC_MAX_tables
#define PYPROXY_BCC_MAX_tables PYPROXY_MAX_SERVICES
#endif
#ifndef PYPROXY_BCC_MAX_affinity
#define PYPROXY_BCC_MAX_affinity PYPROXY_MAX_AFFINITY
#endif
#ifndef PYPROXY_BCC_MAX_epstats
#define PYPROXY_BCC_MAX_epstats PYPROXY_MAX_EPSTATS
#endif

#ifndef PYPROXY_BCC_MAX_services6
#define PYPROXY_BCC_MAX_services6 PYPROXY_MAX_SERVICES
#endif
#ifndef PYPROXY_BCC_MAX_slots6
#define PYPROXY_BCC_MAX_slots6 PYPROXY_MAX_SLOTS
#endif
#ifndef PYPROXY_BCC_MAX_backends6
#define PYPROXY_BCC_MAX_backends6 PYPROXY_MAX_BACKENDS
#endif
#ifndef PYPROXY_BCC_MAX_ct6
#define PYPROXY_BCC_MAX_ct6 PYPROXY_MAX_FLOWS
#endif
#ifndef PYPROXY_BCC_MAX_frags6
#define PYPROXY_BCC_MAX_frags6 PYPROXY_MAX_FRAGS
#endif
#ifndef PYPROXY_BCC_MAX_socks6
#define PYPROXY_BCC_MAX_socks6 PYPROXY_MAX_SOCKS
#endif
#ifndef PYPROXY_BCC_MAX_sockflows6
#define PYPROXY_BCC_MAX_sockflows6 PYPROXY_MAX_SOCKS
#endif
#ifndef PYPROXY_BCC_MAX_sockanswers6
#define PYPROXY_BCC_MAX_sockanswers6 PYPROXY_MAX_SOCKS
#endif
#ifndef PYPROXY_BCC_MAX_srcranges6
#define PYPROXY_BCC_MAX_srcranges6 PYPROXY_MAX_SRCRANGES
#endif
#ifndef PYPROXY_BCC_MAX_affinity6
#define PYPROXY_BCC_MAX_affinity6 PYPROXY_MAX_AFFINITY
#endif
#ifndef PYPROXY_BCC_MAX_epstats6
#define PYPROXY_BCC_MAX_epstats6 PYPROXY_MAX_EPSTATS
#endif
#ifndef PYPROXY_BCC_MAX_tables6
#define PYPROXY_BCC_MAX_tables6 PYPROXY_MAX_SERVICES
#endif

/* What each map is for: maps.h. */
PYPROXY_BCC_TABLE("hash", struct pyproxy_svc_key, struct pyproxy_svc_value, PYPROXY_MAP_SERVICES,
		  PYPROXY_BCC_MAX_services, 0);
PYPROXY_BCC_TABLE("hash", struct pyproxy_slot_key, struct pyproxy_slot, PYPROXY_MAP_SLOTS, PYPROXY_BCC_MAX_slots,
		  BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("hash", struct pyproxy_backend, struct pyproxy_backend_info, PYPROXY_MAP_BACKENDS,
		  PYPROXY_BCC_MAX_backends, BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("hash", struct pyproxy_affinity_key, __u32, PYPROXY_MAP_AFFINITY, PYPROXY_BCC_MAX_affinity,
		  BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_ct_key, struct pyproxy_ct_value, PYPROXY_MAP_CT, PYPROXY_BCC_MAX_ct, 0);
PYPROXY_BCC_TABLE("array", __u32, __u32, PYPROXY_MAP_EPOCH, 1, 0);
PYPROXY_BCC_TABLE("array", __u32, __u64, PYPROXY_MAP_HPIN, 1, 0);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_frag_key, struct pyproxy_frag_value, PYPROXY_MAP_FRAGS,
		  PYPROXY_BCC_MAX_frags, 0);
PYPROXY_BCC_TABLE("array", __u32, __u64, PYPROXY_MAP_PORTS, PYPROXY_PORT_WORDS, 0);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_sock_key, struct pyproxy_sock_value, PYPROXY_MAP_SOCKS,
		  PYPROXY_BCC_MAX_socks, 0);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_sock_key, struct pyproxy_sockflow_value, PYPROXY_MAP_SOCKFLOWS,
		  PYPROXY_BCC_MAX_sockflows, 0);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_sock_key, struct pyproxy_sock_value, PYPROXY_MAP_SOCKANS,
		  PYPROXY_BCC_MAX_sockanswers, 0);
PYPROXY_BCC_TABLE("lpm_trie", struct pyproxy_srcrange_key, __u32, PYPROXY_MAP_SRCRANGES, PYPROXY_BCC_MAX_srcranges,
		  BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("array", __u32, struct pyproxy_cursor, PYPROXY_MAP_CURSORS, PYPROXY_BCC_MAX_cursors, 0);
/* The inner map template of the tables map (BCC names it by its variable; maps.h's struct pyproxy_table_inner):
 * created with each load, never pinned, never filled. */
BPF_F_TABLE("array", __u32, struct pyproxy_backend, pyproxy_table, 1, BPF_F_INNER_MAP);
PYPROXY_BCC_TABLE("hash_of_maps$pyproxy_table", __u32, int, PYPROXY_MAP_TABLES, PYPROXY_BCC_MAX_tables, 0);
PYPROXY_BCC_TABLE("percpu_array", __u32, struct pyproxy_svc_stats, PYPROXY_MAP_STATS, PYPROXY_BCC_MAX_stats, 0);
PYPROXY_BCC_TABLE("percpu_array", __u32, __u64, PYPROXY_MAP_COUNTERS, PYPROXY_CNT_MAX, 0);
PYPROXY_BCC_TABLE("hash", __u32, struct pyproxy_svc_name, PYPROXY_MAP_NAMES, PYPROXY_BCC_MAX_names, BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("percpu_hash", struct pyproxy_backend, struct pyproxy_svc_stats, PYPROXY_MAP_EPSTATS,
		  PYPROXY_BCC_MAX_epstats, BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("hash", __u32, __be32, PYPROXY_MAP_DEVADDRS, PYPROXY_MAX_DEVADDRS, BPF_F_NO_PREALLOC);

/* IPv6 (maps.h). */
PYPROXY_BCC_TABLE("hash", struct pyproxy_svc6_key, struct pyproxy_svc_value, PYPROXY_MAP_SERVICES6,
		  PYPROXY_BCC_MAX_services6, 0);
PYPROXY_BCC_TABLE("hash", struct pyproxy_slot_key, struct pyproxy_slot6, PYPROXY_MAP_SLOTS6, PYPROXY_BCC_MAX_slots6,
		  BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("hash", struct pyproxy_backend6, struct pyproxy_backend_info, PYPROXY_MAP_BACKENDS6,
		  PYPROXY_BCC_MAX_backends6, BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("hash", struct pyproxy_affinity6_key, __u32, PYPROXY_MAP_AFFINITY6, PYPROXY_BCC_MAX_affinity6,
		  BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_ct6_key, struct pyproxy_ct6_value, PYPROXY_MAP_CT6, PYPROXY_BCC_MAX_ct6,
		  0);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_frag6_key, struct pyproxy_frag_value, PYPROXY_MAP_FRAGS6,
		  PYPROXY_BCC_MAX_frags6, 0);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_sock6_key, struct pyproxy_sock6_value, PYPROXY_MAP_SOCKS6,
		  PYPROXY_BCC_MAX_socks6, 0);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_sock6_key, struct pyproxy_sockflow6_value, PYPROXY_MAP_SOCKFLOWS6,
		  PYPROXY_BCC_MAX_sockflows6, 0);
PYPROXY_BCC_TABLE("lru_hash", struct pyproxy_sock6_key, struct pyproxy_sock6_value, PYPROXY_MAP_SOCKANS6,
		  PYPROXY_BCC_MAX_sockanswers6, 0);
PYPROXY_BCC_TABLE("lpm_trie", struct pyproxy_srcrange6_key, __u32, PYPROXY_MAP_SRCRANGES6,
		  PYPROXY_BCC_MAX_srcranges6, BPF_F_NO_PREALLOC);
BPF_F_TABLE("array", __u32, struct pyproxy_backend6, pyproxy_table6, 1, BPF_F_INNER_MAP);
PYPROXY_BCC_TABLE("hash_of_maps$pyproxy_table6", __u32, int, PYPROXY_MAP_TABLES6, PYPROXY_BCC_MAX_tables6, 0);
PYPROXY_BCC_TABLE("hash", __u32, struct pyproxy_in6, PYPROXY_MAP_DEVADDRS6, PYPROXY_MAX_DEVADDRS, BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("percpu_array", __u32, struct pyproxy_refusal_bucket, PYPROXY_MAP_REFUSALS, 1, 0);
PYPROXY_BCC_TABLE("percpu_hash", struct pyproxy_backend6, struct pyproxy_svc_stats, PYPROXY_MAP_EPSTATS6,
		  PYPROXY_BCC_MAX_epstats6, BPF_F_NO_PREALLOC);
PYPROXY_BCC_TABLE("prog", __u32, __u32, PYPROXY_MAP_JUMP6, PYPROXY_JUMP6_TC_MAX, 0);
PYPROXY_BCC_TABLE("prog", __u32, __u32, PYPROXY_MAP_XJUMP6, PYPROXY_JUMP6_XDP_MAX, 0);

#else /* the programs */

/* Newer than the kernel headers BCC compiles against (Debian's 6.1: make install-bcc), values of uapi/linux/bpf.h;
 * whether the running kernel takes them is its own affair, as with libbpf's build. */
#ifndef BPF_FIB_LOOKUP_SKIP_NEIGH
#define BPF_FIB_LOOKUP_SKIP_NEIGH (1U << 2)
#endif
#ifndef BPF_FIB_LOOKUP_SRC
#define BPF_FIB_LOOKUP_SRC (1U << 4)
#endif

/* A map the loader made in step 1, by its fd: `&PYPROXY_MAP_CT` becomes the map reference BCC's rewriter emits. */
struct pyproxy_bcc_map {
	int unused;
};
#define PYPROXY_BCC_MAP(fd) (*(struct pyproxy_bcc_map *)(long)bpf_pseudo_fd(1, fd))

/* bpf_tail_call: BCC declares the helper only as bpf_tail_call_(map fd, ctx, index), the map's first, for its
 * rewriter's `table.call(ctx, index)`; a map here is already its reference (PYPROXY_BCC_MAP), which the helper takes
 * as it is. */
#define bpf_tail_call(ctx, map, index) bpf_tail_call_((u64)(long)(map), (ctx), (index))

/* The programs' constants (maps.h's .rodata pyproxy_config): a compound literal of -DPYPROXY_BCC_CONFIG={...},
 * which the loader writes from the same settings. Every read is a constant folded by the compiler, as the verifier
 * folds libbpf's frozen .rodata. */
#ifndef PYPROXY_BCC_CONFIG
#error "PYPROXY_BCC_CONFIG: the loader passes the programs' constants"
#endif
#define pyproxy_config ((const struct pyproxy_config)PYPROXY_BCC_CONFIG)

/* BCC 0.26 sets no target CPU for its code generator: BPF v1, whose atomic add returns nothing ("Invalid usage of
 * the XADD return value"; libbpf's build asks for -mcpu=v3, sched.h). Where the old value is used (the rr and wrr
 * cursor) it is read before the add: two CPUs taking a turn at the same moment may get the same one, so under BCC
 * round robin is round robin but for such collisions. An add whose value is unused stays one atomic add. */
#define __sync_fetch_and_add(p, v)                                                                          \
	({                                                                                                  \
		__typeof__(*(p)) __old = *(volatile __typeof__(*(p)) *)(p);                                 \
		__sync_fetch_and_add((p), (v));                                                             \
		__old;                                                                                      \
	})

/* bpf_loop: BCC 0.26 does not relocate the callback (a static function, the ld_imm64 of a BPF_PSEUDO_FUNC): the
 * verifier finds 0 where the function should be ("R2 type=scalar expected=func"). Under BCC the loop is an
 * ordinary bounded loop calling the callback, inlined, and the verifier walks every iteration, so each loop has a
 * cap, PYPROXY_BCC_LOOPS_<callback>. Its shape is the verifier's: a constant trip count (the cap) with the real
 * count read through a volatile, since clang otherwise folds min(count, cap) into a countdown the verifier cannot
 * bound ("The sequence of 8193 jumps is too complex"); and not unrolled (less code for the verifier to walk).
 * Measured on 6.18: SNAT's 32 tries fit, as with bpf_loop (the loop converges: 16 or 32 cost the same); lc, sed and
 * nq scan 8 backends, not 256: the XDP program is the verifier's heaviest under BCC, 690,000 to 816,000 of its
 * million instructions at 8 depending on the constants, and at 16 some constants (short UDP timeouts) pass the
 * million ("Argument list too long"). */
#define bpf_loop(nr, cb, data, flags)                                                                       \
	({                                                                                                  \
		volatile __u32 __n = (nr);                                                                  \
		__u32 __i;                                                                                  \
		_Pragma("clang loop unroll(disable)")                                                       \
		for (__i = 0; __i < PYPROXY_BCC_LOOPS_##cb; __i++)                                          \
			if (__i >= __n || cb(__i, data))                                                    \
				break;                                                                      \
		(long)__i;                                                                                  \
	})
#define PYPROXY_BCC_LOOPS_pyproxy_snat_try PYPROXY_SNAT_TRIES
#define PYPROXY_BCC_LOOPS_pyproxy_snat_try_early 1
#define PYPROXY_BCC_LOOPS_pyproxy_least_step 8

#endif /* PYPROXY_BCC_TABLES */

#endif
