/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Schedulers: which backend a new flow of a frontend gets (struct pyproxy_svc_value.sched). Only new flows pay
 * for it: an established flow follows its CT entry (lb.h), so no scheduler touches the established path. The
 * cost per new flow, beyond today's random choice (one random number, one slot lookup):
 *   random, sh, dh   none (a hash of an address instead of a random number)
 *   rr               an atomic add on the frontend's cursor (an array, inlined)
 *   wrr, maglev      two lookups (the frontend's table, its entry: an array) instead of the slot lookup
 *   lc, sed, nq      two lookups per backend scanned (slot, active count), at most PYPROXY_LEAST_SCAN backends,
 *                    and an atomic add on the chosen backend's count; one more atomic add when the flow ends
 * The tables and weights are computed by the control plane (pyproxy/dataplane/bpf/maglev.py, render.py).
 */
#ifndef PYPROXY_SCHED_H
#define PYPROXY_SCHED_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "pyproxy/counters.h"
#include "pyproxy/maps.h"
#include "pyproxy/parse.h"

/* How many backends lc, sed and nq compare per new flow. A frontend with more has a window of this many, at a
 * random place, compared: the choice stays bounded (README, "Schedulers"), and over many flows every backend is
 * in some windows. bpf_loop keeps the verifier's work to one step's whatever the bound. */
#define PYPROXY_LEAST_SCAN 256

/* murmur3's finalizer: spreads every input bit over the result, so `% count` of it is even for addresses that
 * differ in a few low bits (a pod CIDR's clients). */
static __always_inline __u32 pyproxy_mix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

/* A flow's hash for Maglev: its 5-tuple, so every node (and this one after its CT entry is gone) sends the
 * flow to the same backend while the backends stay. */
static __always_inline __u32 pyproxy_flow_hash(const struct pyproxy_pkt *p)
{
	__u32 h = pyproxy_mix32(p->saddr ^ 0x9e3779b9);

	h = pyproxy_mix32(h ^ p->daddr);
	h = pyproxy_mix32(h ^ (((__u32)p->sport << 16) | p->dport));
	return pyproxy_mix32(h ^ p->proto);
}

/* The frontend's slot `slot` (0..backend_count-1): the backend, and its weight (0 reads as 1). */
static __always_inline int pyproxy_slot_get(__u32 svc_id, __u32 slot, struct pyproxy_backend *be, __u32 *weight)
{
	struct pyproxy_slot_key sk = { .svc_id = svc_id, .slot = slot };
	struct pyproxy_slot *s = bpf_map_lookup_elem(&PYPROXY_MAP_SLOTS, &sk);

	if (!s)
		return 0;
	be->addr = s->addr;
	be->port = s->port;
	be->pad = 0;
	if (weight)
		*weight = s->weight ? s->weight : 1;
	return 1;
}

/* Entry `i` of the frontend's wrr or Maglev table. 0: no such entry (the table is being replaced by one of
 * another size, or not written yet). */
static __always_inline int pyproxy_table_get(__u32 svc_id, __u32 i, struct pyproxy_backend *be)
{
	void *table = bpf_map_lookup_elem(&PYPROXY_MAP_TABLES, &svc_id);
	struct pyproxy_backend *t;

	if (!table)
		return 0;
	t = bpf_map_lookup_elem(table, &i);
	if (!t || !t->addr)
		return 0;
	*be = *t;
	return 1;
}

/* The frontend's next turn (rr, wrr): one cursor for every CPU, so a burst on several CPUs still takes the
 * backends in turn (no per-CPU unevenness). */
static __always_inline __u32 pyproxy_next_turn(__u32 svc_id)
{
	struct pyproxy_cursor *c = bpf_map_lookup_elem(&PYPROXY_MAP_CURSORS, &svc_id);

	return c ? __sync_fetch_and_add(&c->next, 1) : bpf_get_prandom_u32();
}

/* The open flows a backend has (lc, sed, nq): its count, read as 0 while a recount left it negative. */
static __always_inline __u32 pyproxy_active(const struct pyproxy_backend *be)
{
	struct pyproxy_backend_info *info = bpf_map_lookup_elem(&PYPROXY_MAP_BACKENDS, be);
	__s32 n = info ? info->active : 0;

	return n > 0 ? n : 0;
}

/* One more (`delta` 1) or one fewer (-1) open flow to a backend. */
static __always_inline void pyproxy_active_add(const struct pyproxy_backend *be, int delta)
{
	struct pyproxy_backend_info *info = bpf_map_lookup_elem(&PYPROXY_MAP_BACKENDS, be);

	if (info)
		__sync_fetch_and_add(&info->active, delta);
}

/* A least-loaded search's "no best load yet": ~0, kept in writable global data (.data, never written) rather than
 * written as a constant, so the verifier cannot know it. Verifiers before 6.7 check a bpf_loop callback once, in the
 * state the caller left its context in, and drop the code that state never reaches: with the constant, the
 * comparison with the best load so far (`l->num == ~0` was always true to them), so on Debian's 6.1 every step
 * replaced the best and lc, sed and nq took the last backend scanned (tests/priv/test_schedulers.py in the 6.1
 * guest). An unknown start keeps both ways on every kernel; it costs one load per new flow of these schedulers. */
#ifdef PYPROXY_BCC
/* BCC has no global data, and needs none: its loops are inlined (bcc.h), so the verifier walks every step in its
 * own state. */
#define pyproxy_no_load (~0ULL)
#else
static volatile __u64 pyproxy_no_load = ~0ULL;
#endif

/* A least-loaded comparison in progress, whatever the family: the best load so far, as a fraction num/den (lc's active
 * flows, sed's and nq's (active + 1) / weight). */
struct pyproxy_load {
	__u64 num, den;                /* num = pyproxy_no_load: none yet */
	__u32 sched;                   /* PYPROXY_SCHED_LC, _SED or _NQ */
	__u32 pad;
};

/* The address-independent half of an lc, sed or nq step: whether a backend with `active` open flows and `weight` is
 * the new best (1), the new best and the end of the scan (2: nq's idle backend), or not (0). */
static __always_inline int pyproxy_load_better(struct pyproxy_load *l, __u32 active, __u32 weight)
{
	__u64 num, den;

	if (l->sched == PYPROXY_SCHED_LC) {
		num = active;
		den = 1;
	} else {
		if (l->sched == PYPROXY_SCHED_NQ && active == 0) {
			/* Never queue: an idle backend is taken at once, whatever its weight. */
			l->num = 0;
			return 2;
		}
		num = active + 1;
		den = weight;
	}
	if (l->num == pyproxy_no_load || num * l->den < l->num * den) {
		l->num = num;
		l->den = den;
		return 1;
	}
	return 0;
}

/* A least-loaded choice in progress, as bpf_loop hands it to each step. */
struct pyproxy_least {
	__u32 svc_id;
	__u32 start;                   /* the first slot compared: a random one, so ties spread */
	__u32 count;                   /* the frontend's slots */
	__u32 pad;
	struct pyproxy_load load;
	struct pyproxy_backend best;
};

static long pyproxy_least_step(__u32 i, void *data)
{
	struct pyproxy_least *l = data;
	struct pyproxy_backend be;
	__u32 weight;
	int better;

	if (!l->count || !pyproxy_slot_get(l->svc_id, (l->start + i) % l->count, &be, &weight))
		return 0;
	better = pyproxy_load_better(&l->load, pyproxy_active(&be), weight);
	if (better)
		l->best = be;
	return better == 2;
}

static __always_inline int pyproxy_pick_least(const struct pyproxy_svc_value *svc, struct pyproxy_backend *be)
{
	struct pyproxy_least l = {
		.svc_id = svc->svc_id, .start = bpf_get_prandom_u32() % svc->backend_count,
		.count = svc->backend_count, .load = { .sched = svc->sched, .num = pyproxy_no_load, .den = 1 },
	};
	__u32 n = svc->backend_count < PYPROXY_LEAST_SCAN ? svc->backend_count : PYPROXY_LEAST_SCAN;

	bpf_loop(n, pyproxy_least_step, &l, 0);
	if (l.load.num == pyproxy_no_load)
		return 0;
	*be = l.best;
	return 1;
}

/* What a frontend's scheduler makes of a new flow, whatever the family (struct pyproxy_svc_value.sched). */
enum pyproxy_pick {
	PYPROXY_PICK_SLOT = 0,   /* slot *i of the frontend */
	PYPROXY_PICK_TABLE,      /* entry *i of its table (wrr, maglev); a missing one: a random slot */
	PYPROXY_PICK_LEAST,      /* the least loaded of its slots (lc, sed, nq): a scan of the family's own */
};

/* The address-independent half of every scheduler, shared by both families: `src` and `dst` are the client's and
 * the frontend's address (an IPv6 one folded to 32 bits), `flow` the flow's hash (read by Maglev only). */
static __always_inline int pyproxy_sched_pick(const struct pyproxy_svc_value *svc, __u32 src, __u32 dst, __u32 flow,
					      __u32 *i)
{
	__u32 n = svc->backend_count;

	switch (svc->sched) {
	case PYPROXY_SCHED_RR:
		*i = pyproxy_next_turn(svc->svc_id) % n;
		return PYPROXY_PICK_SLOT;
	case PYPROXY_SCHED_WRR:
		if (!svc->table_size)
			break;
		*i = pyproxy_next_turn(svc->svc_id) % svc->table_size;
		return PYPROXY_PICK_TABLE;
	case PYPROXY_SCHED_MAGLEV:
		if (!svc->table_size)
			break;
		*i = flow % svc->table_size;
		return PYPROXY_PICK_TABLE;
	case PYPROXY_SCHED_LC:
	case PYPROXY_SCHED_SED:
	case PYPROXY_SCHED_NQ:
		return PYPROXY_PICK_LEAST;
	case PYPROXY_SCHED_SH:
		*i = pyproxy_mix32(src) % n;
		return PYPROXY_PICK_SLOT;
	case PYPROXY_SCHED_DH:
		*i = pyproxy_mix32(dst) % n;
		return PYPROXY_PICK_SLOT;
	}
	*i = bpf_get_prandom_u32() % n;
	return PYPROXY_PICK_SLOT;
}

/* The backend for a new flow `p` of frontend `svc` (backend_count > 0), by the frontend's scheduler. 0: a slot
 * was missing (the control plane mid-update). A table scheduler whose table is not there (not written yet, or
 * being replaced by one of another size) chooses at random meanwhile: a moment's uneven choice, never a drop. */
static __always_inline int pyproxy_pick_backend(const struct pyproxy_pkt *p, const struct pyproxy_svc_value *svc,
						struct pyproxy_backend *be)
{
	__u32 i;

	switch (pyproxy_sched_pick(svc, p->saddr, p->daddr,
				   svc->sched == PYPROXY_SCHED_MAGLEV ? pyproxy_flow_hash(p) : 0, &i)) {
	case PYPROXY_PICK_LEAST:
		return pyproxy_pick_least(svc, be);
	case PYPROXY_PICK_TABLE:
		if (pyproxy_table_get(svc->svc_id, i, be))
			return 1;
		i = bpf_get_prandom_u32() % svc->backend_count;
	}
	return pyproxy_slot_get(svc->svc_id, i, be, 0);
}

/* Whether a frontend's flows are counted in their backends' active flows (PYPROXY_CT_F_COUNTED). */
static __always_inline int pyproxy_sched_counts(const struct pyproxy_svc_value *svc)
{
	return svc->sched == PYPROXY_SCHED_LC || svc->sched == PYPROXY_SCHED_SED || svc->sched == PYPROXY_SCHED_NQ;
}

#endif
