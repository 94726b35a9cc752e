/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * The one definition of everything the BPF programs and the Python control plane share: map names,
 * map key/value structs, flags and counter indices. pyproxy/dataplane/bpf/abi.py mirrors each struct by
 * name; tests/priv/test_abi.py compares both against the BTF of the compiled object.
 *
 * Rules: every struct is padded explicitly so its size has no hidden holes (hash keys are compared
 * bytewise, so a hole would make equal keys differ); byte order is stated per field; a layout change
 * bumps the map's _vN suffix so a restarted pyproxy never reuses a pinned map of the old shape.
 */
#ifndef PYPROXY_ABI_H
#define PYPROXY_ABI_H

#include <linux/types.h>

/* Map names (also the pin file names). Kernel object names hold 15 characters. */
#define PYPROXY_MAP_SERVICES  pyproxy_svc_v2   /* v2: affinity in ticks, not seconds */
#define PYPROXY_MAP_SLOTS     pyproxy_slot_v1
#define PYPROXY_MAP_BACKENDS  pyproxy_be_v1
#define PYPROXY_MAP_CT        pyproxy_ct_v2    /* v2: last_seen in ticks, not ns */
#define PYPROXY_MAP_STATS     pyproxy_stat_v1
#define PYPROXY_MAP_COUNTERS  pyproxy_cnt_v1
#define PYPROXY_MAP_NAMES     pyproxy_name_v1
#define PYPROXY_MAP_EPOCH     pyproxy_epoch_v1

/* Default capacities; the loader may resize before load (bpf_map__set_max_entries). */
#define PYPROXY_MAX_SERVICES  131072   /* frontends: ClusterIP x port x protocol */
#define PYPROXY_MAX_SLOTS     2097152  /* sum over frontends of ready backends */
#define PYPROXY_MAX_BACKENDS  1048576  /* distinct backend ip:port */
#define PYPROXY_MAX_FLOWS     262144   /* connection-tracking entries, two per flow */

/* struct pyproxy_svc_value.flags */
#define PYPROXY_SVC_F_AFFINITY  0x1    /* ClientIP session affinity: a client keeps its backend */

/* struct pyproxy_ct_key.dir */
#define PYPROXY_CT_FORWARD  0          /* client -> frontend, value holds the backend */
#define PYPROXY_CT_REVERSE  1          /* backend -> client, value holds the frontend to restore */
#define PYPROXY_CT_AFFINITY 2          /* client -> frontend with ports zeroed: ClientIP affinity */

/* Indices of PYPROXY_MAP_COUNTERS (per-CPU __u64 each). */
enum pyproxy_counter {
	PYPROXY_CNT_NEW_FLOW = 0,      /* a new flow was assigned a backend */
	PYPROXY_CNT_ESTABLISHED,       /* a packet followed an existing flow's backend */
	PYPROXY_CNT_REVNAT,            /* a reply got its frontend address back */
	PYPROXY_CNT_NO_BACKEND,        /* dropped: frontend with no ready backend */
	PYPROXY_CNT_REBALANCED,        /* a flow's backend was gone, a new one was chosen */
	PYPROXY_CNT_SLOT_MISS,         /* dropped: slot missing (control plane mid-update) */
	PYPROXY_CNT_CT_FULL,           /* a flow could not be recorded (map update failed) */
	PYPROXY_CNT_MAX,
};

/* Key of PYPROXY_MAP_SERVICES: one frontend. */
struct pyproxy_svc_key {
	__be32 vip;    /* network byte order */
	__be16 port;   /* network byte order */
	__u8 proto;    /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad;      /* zero */
};

struct pyproxy_svc_value {
	__u32 svc_id;          /* host order; index into PYPROXY_MAP_STATS and key part of slots */
	__u16 backend_count;   /* host order; ready backends in slots 0..count-1; 0 = drop */
	__u16 flags;           /* host order; PYPROXY_SVC_F_* */
	__u32 affinity_ticks;  /* host order; ClientIP affinity timeout in ticks (jiffies) when PYPROXY_SVC_F_AFFINITY */
	__u32 pad;             /* zero */
};

/* Key of PYPROXY_MAP_SLOTS: the n-th ready backend of a frontend. */
struct pyproxy_slot_key {
	__u32 svc_id;  /* host order */
	__u32 slot;    /* host order, 0..backend_count-1 */
};

/* A backend address: value of PYPROXY_MAP_SLOTS and key of PYPROXY_MAP_BACKENDS. */
struct pyproxy_backend {
	__be32 addr;   /* network byte order */
	__be16 port;   /* network byte order */
	__u16 pad;     /* zero */
};

/* Value of PYPROXY_MAP_BACKENDS: the backend is an endpoint of some slice (ready or not). */
struct pyproxy_backend_info {
	__u32 flags;   /* host order; reserved, zero */
	__u32 pad;     /* zero */
};

/* Key of PYPROXY_MAP_CT: a flow as seen on the wire in one direction. */
struct pyproxy_ct_key {
	__be32 saddr;  /* network byte order */
	__be32 daddr;  /* network byte order */
	__be16 sport;  /* network byte order */
	__be16 dport;  /* network byte order */
	__u8 proto;    /* IPPROTO_* */
	__u8 dir;      /* PYPROXY_CT_* */
	__u16 pad;     /* zero */
};

struct pyproxy_ct_value {
	__be32 nat_addr;   /* network order; FORWARD: backend, REVERSE: frontend VIP */
	__be16 nat_port;   /* network order */
	__u16 pad;         /* zero */
	__u32 svc_id;      /* host order; the frontend this flow belongs to */
	/* host order; FORWARD: the backends epoch (PYPROXY_MAP_EPOCH) at which the backend was last seen to be an
	 * endpoint. It took the place of a zero pad with no version bump: entries of older versions read as 0,
	 * an epoch the control plane never makes current, so they are checked once and connections survive. */
	__u32 epoch;
	__u64 last_seen;   /* host order; jiffies (bpf_jiffies64) of its last packet */
};

/* Value of PYPROXY_MAP_STATS (per-CPU): traffic from clients to one frontend. */
struct pyproxy_svc_stats {
	__u64 packets;  /* host order */
	__u64 bytes;    /* host order */
};

#define PYPROXY_NAME_LEN 128

/* Value of PYPROXY_MAP_NAMES: which Service port a frontend serves, "namespace/name[:port]". */
struct pyproxy_svc_name {
	char name[PYPROXY_NAME_LEN];   /* NUL-terminated */
};

#endif /* PYPROXY_ABI_H */
