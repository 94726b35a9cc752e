/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
#ifndef PYPROXY_COUNTERS_H
#define PYPROXY_COUNTERS_H

#include "pyproxy/maps.h"

static __always_inline void pyproxy_count(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&PYPROXY_MAP_COUNTERS, &idx);

	if (v)
		*v += 1;
}

/* One more packet of `bytes` in a per-CPU stats entry (none: not counted). */
static __always_inline void pyproxy_stats_add(struct pyproxy_svc_stats *st, __u64 bytes)
{
	if (st) {
		st->packets += 1;
		st->bytes += bytes;
	}
}

static __always_inline void pyproxy_count_svc(__u32 svc_id, __u64 bytes)
{
	pyproxy_stats_add(bpf_map_lookup_elem(&PYPROXY_MAP_STATS, &svc_id), bytes);
}

/* Service traffic sent to backend *be, counted per backend too when the loader asked for it (see
 * pyproxy_config.endpoint_counters: a constant, so with counting off this is no code at all). */
static __always_inline void pyproxy_count_endpoint(const struct pyproxy_backend *be, __u64 bytes)
{
	if (pyproxy_config.endpoint_counters)
		pyproxy_stats_add(bpf_map_lookup_elem(&PYPROXY_MAP_EPSTATS, be), bytes);
}

/* The same for an IPv6 backend (PYPROXY_MAP_EPSTATS6). */
static __always_inline void pyproxy_count_endpoint6(const struct pyproxy_backend6 *be, __u64 bytes)
{
	if (pyproxy_config.endpoint_counters)
		pyproxy_stats_add(bpf_map_lookup_elem(&PYPROXY_MAP_EPSTATS6, be), bytes);
}

#endif
