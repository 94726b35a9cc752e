/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Connection tracking: the flow lifecycle of PYPROXY_MAP_CT.
 *
 * A flow has two entries, FORWARD (client -> frontend, holds the backend) and REVERSE (backend -> client,
 * holds the frontend), each with the flow's state and the tick of the last packet seen in its direction.
 * As in the kernel's conntrack and Cilium's, the state picks an idle timeout (pyproxy_config.ct). TCP:
 *
 *   NEW --SYN-ACK--> SYN_RECV --client's ACK--> ESTABLISHED --FIN--> CLOSING --other FIN--> TIME_WAIT
 *   RST from any state --> CLOSED (past NEW: only a RST within its sender's sequence window, below)
 *
 * A flow is not established by its backend's answer alone: until the client's next packet it is half open and
 * expires in the SYN-received timeout (60 s), so a flood of SYNs that never complete holds nothing for a day. A
 * retransmitted SYN on a flow in NEW or SYN_RECV (its first SYN-ACK was lost) is the same connection: it follows
 * the flow, to the same backend through the same SNAT port (lb.h); only a SYN on a closing or closed flow opens a
 * new one on its ports. UDP, as the kernel's udp tracker:
 *
 *   NEW --reply--> SYN_RECV ("replied": a single exchange so far, the UDP timeout, 30 s)
 *   SYN_RECV --a packet more than udp_stream_after (2 s) after the flow began--> ESTABLISHED (a stream, 120 s)
 *
 * so a DNS query and its answer hold an SNAT port 30 s, not the stream timeout.
 *
 * The RST window. A RST closes a flow only when it lies where its sender's segments are: each entry keeps the end
 * of the furthest segment its sender sent (seq_end: seq + payload + SYN + FIN), and a RST from that sender
 * (the entry's own direction, so no second lookup) closes the flow only if its seq is within
 * PYPROXY_CT_SEQ_WINDOW of it either way. Any other RST leaves the flow as it was, state, timeout and SNAT pair, is
 * counted (ct_rst_ignored) and passed on translated: the endpoint's own stack ignores it, or answers with a
 * challenge ACK (RFC 5961), to which a real peer answers with a RST at the very sequence. An injected RST must
 * so guess a 2^19-wide window in 2^32 where before any one did (the defect: a 24 h flow dropped to 10 s, its SNAT
 * port freed). Why this rule and this width:
 *  - Linux accepts a RST only at rcv_nxt (RFC 5961) and nf_conntrack closes on one at the receiver's highest ACK
 *    or its sender's last end. That needs the peer's ACKs and a state per direction; the CT value has room for
 *    one 32-bit field, and the sender's own end sits in the entry the RST already hit. A legitimate RST lies at
 *    that end (an abort: seq = snd_nxt) or at most a window of unacknowledged data behind it (an answer from a
 *    socket that is gone: seq = the peer's ACK), and data lost before the node puts it ahead: 256 KiB either way
 *    covers a receive window of Linux's defaults and a burst of ~180 lost full-size segments.
 *  - A segment moves seq_end only if it starts within the same window and ends past it (retransmissions move
 *    nothing): else one spoofed data packet far ahead, then a RST there, would close the flow in two packets.
 *    A loss burst wider than the window seen by the node leaves seq_end behind for good: that flow's RSTs are
 *    then ignored and it ends as it did before RSTs closed flows, by FIN or its idle timeout.
 *  - RSTs in NEW are accepted (a refusal of the SYN, or the client giving up: its sequence is the SYN's); the
 *    backend's entry learns its sequence while the flow is NEW (its SYN-ACK), so the check starts at SYN_RECV.
 *  - Flows carried over from the layout before seq_end (PYPROXY_CT_F_SEQ_UNKNOWN) take any RST, as before.
 *  - The cost: a data segment stores seq_end into the entry its lookup just read (the same 32 bytes as
 *    last_seen); a pure ACK, whose end does not move, stores nothing, nor does any UDP packet.
 *
 * An entry is live while it, or its peer entry (the other direction of the same flow), saw a packet within
 * its timeout; anything else is treated as absent: never followed, never used for reverse NAT. The entries
 * stay until a new flow overwrites them, the LRU evicts them, or the control plane's collector deletes them.
 *
 * A connection that ends leaves its entries behind for a while, and a later connection on the same ports must
 * not be captured by them: a SYN on a closing or closed flow starts a new flow (lb.h), a SYN or datagram
 * that is no Service's removes the flow whose reverse entry would rewrite its replies (pyproxy_ct_untrack), and
 * any new flow removes an SNAT pair that would rewrite its source (pyproxy_ct_forget_snat).
 */
#ifndef PYPROXY_CT_H
#define PYPROXY_CT_H

#include "pyproxy/counters.h"
#include "pyproxy/maps.h"
#include "pyproxy/parse.h"
#include "pyproxy/sched.h"

static __always_inline void pyproxy_ct_key_set(struct pyproxy_ct_key *k, __be32 saddr, __be32 daddr, __be16 sport,
					       __be16 dport, __u8 proto, __u8 dir)
{
	k->saddr = saddr;
	k->daddr = daddr;
	k->sport = sport;
	k->dport = dport;
	k->proto = proto;
	k->dir = dir;
	k->pad = 0;
}

static __always_inline void pyproxy_ct_key_of(const struct pyproxy_pkt *p, __u8 dir, struct pyproxy_ct_key *k)
{
	pyproxy_ct_key_set(k, p->saddr, p->daddr, p->sport, p->dport, p->proto, dir);
}

/* The clock of last_seen and of ClientIP affinity, in ticks (jiffies; HZ per second, which the control plane
 * finds out and converts with). The verifier inlines bpf_jiffies64() into one load; measured here
 * (bench/steps.bpf.c), bpf_ktime_get_coarse_ns() cost 17-22 ns a packet and bpf_ktime_get_ns() 30 ns, a
 * sixth and a quarter of an established flow, for a resolution that idle ages and affinity timeouts in
 * seconds do not need. (Cilium keeps its conntrack clock in jiffies for the same reason.) */
static __always_inline __u64 pyproxy_now(void)
{
	return bpf_jiffies64();
}

static __always_inline __u32 pyproxy_backends_epoch(void)
{
	__u32 zero = 0;
	__u32 *epoch = bpf_map_lookup_elem(&PYPROXY_MAP_EPOCH, &zero);

	return epoch ? *epoch : 0;
}

static __always_inline struct pyproxy_ct_value *pyproxy_ct_lookup(const struct pyproxy_pkt *p, __u8 dir)
{
	struct pyproxy_ct_key k;

	pyproxy_ct_key_of(p, dir, &k);
	return bpf_map_lookup_elem(&PYPROXY_MAP_CT, &k);
}

/* The idle timeout of an entry in `state`: constants of the loaded program, folded by the verifier. */
static __always_inline __u32 pyproxy_ct_timeout(__u8 proto, __u8 state)
{
	if (proto == IPPROTO_TCP) {
		switch (state) {
		case PYPROXY_CT_ST_NEW:
			return pyproxy_config.ct.tcp_new;
		case PYPROXY_CT_ST_SYN_RECV:
			return pyproxy_config.ct.tcp_syn_recv;
		case PYPROXY_CT_ST_CLOSING:
			return pyproxy_config.ct.tcp_closing;
		case PYPROXY_CT_ST_TIME_WAIT:
			return pyproxy_config.ct.tcp_time_wait;
		case PYPROXY_CT_ST_CLOSED:
			return pyproxy_config.ct.tcp_closed;
		default:
			return pyproxy_config.ct.tcp_established;
		}
	}
	return state == PYPROXY_CT_ST_NEW || state == PYPROXY_CT_ST_SYN_RECV ? pyproxy_config.ct.udp_new
									       : pyproxy_config.ct.udp_established;
}

/* Whether a TCP flow in `state` is over: closed by a RST or by FINs both ways. */
static __always_inline int pyproxy_ct_over(__u8 state)
{
	return state == PYPROXY_CT_ST_CLOSED || state == PYPROXY_CT_ST_TIME_WAIT;
}

/* Whether a SYN on a flow in `state` opens a new connection on its ports: the flow is closing or over. A SYN in
 * NEW or SYN_RECV is a retransmission (the client did not get the SYN-ACK), and one on an established flow the
 * backend sorts out (it answers an unknown SYN, or challenges a stale one): both follow the flow. */
static __always_inline int pyproxy_ct_reopens(__u8 state)
{
	return state == PYPROXY_CT_ST_CLOSING || pyproxy_ct_over(state);
}

/* Whether a flow that began at tick `born` (its low 32 bits) is old enough, at `now`, for a replied UDP flow to be a
 * stream (the kernel's rule: traffic both ways, and a packet more than 2 s after the first). */
static __always_inline int pyproxy_ct_stream_due(__u32 born, __u64 now)
{
	return (__u32)now - born > pyproxy_config.ct.udp_stream_after;
}

/* Whether an entry last seen at `last_seen` in `state` is past its idle timeout (both families' entries). */
static __always_inline int pyproxy_ct_idle_expired(__u64 last_seen, __u8 state, __u8 proto, __u64 now)
{
	__u64 idle = now - last_seen;

	/* Idle for less than the shortest timeout: live in any state, without working out which. */
	return idle > pyproxy_config.ct.shortest && idle > pyproxy_ct_timeout(proto, state);
}

static __always_inline int pyproxy_ct_expired(const struct pyproxy_ct_value *v, __u8 proto, __u64 now)
{
	return pyproxy_ct_idle_expired(v->last_seen, v->state, proto, now);
}

/* The key of the other direction's entry of the flow that `v`, found under `k`, belongs to:
 * FORWARD (client, frontend) -> REVERSE (backend, client) and back. */
static __always_inline void pyproxy_ct_peer_key(const struct pyproxy_ct_key *k, const struct pyproxy_ct_value *v,
						struct pyproxy_ct_key *peer)
{
	int fwd = k->dir == PYPROXY_CT_FORWARD;

	peer->saddr = fwd ? v->nat_addr : k->daddr;
	peer->daddr = fwd ? k->saddr : v->nat_addr;
	peer->sport = fwd ? v->nat_port : k->dport;
	peer->dport = fwd ? k->sport : v->nat_port;
	peer->proto = k->proto;
	peer->dir = fwd ? PYPROXY_CT_REVERSE : PYPROXY_CT_FORWARD;
	peer->pad = 0;
}

/* The peer entry of `v`, if it is the other half of the same flow (it points back at `k`'s frontend or
 * client: an entry under the peer's key may belong to another flow that reached the same backend). */
static __always_inline struct pyproxy_ct_value *pyproxy_ct_peer(const struct pyproxy_ct_key *k,
								const struct pyproxy_ct_value *v)
{
	struct pyproxy_ct_key pk;
	struct pyproxy_ct_value *peer;

	pyproxy_ct_peer_key(k, v, &pk);
	peer = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &pk);
	if (!peer)
		return NULL;
	if (k->dir == PYPROXY_CT_FORWARD ? peer->nat_addr != k->daddr || peer->nat_port != k->dport
					 : peer->nat_addr != k->saddr || peer->nat_port != k->sport)
		return NULL;
	return peer;
}

/* Whether the flow of entry `v` is live: it saw a packet within its timeout, or its peer did (a one-way
 * stream refreshes only one direction's entry). Only an entry past its own timeout pays the peer lookup. */
static __always_inline int pyproxy_ct_live(const struct pyproxy_ct_key *k, const struct pyproxy_ct_value *v,
					   __u64 now)
{
	struct pyproxy_ct_value *peer;

	if (!pyproxy_ct_expired(v, k->proto, now))
		return 1;
	peer = pyproxy_ct_peer(k, v);
	return peer && !pyproxy_ct_expired(peer, k->proto, now);
}

/* How far from its sender's furthest segment end a RST may lie and still close a flow, and a segment start and still
 * move that end on (the RST window, above): 256 KiB either way. */
#define PYPROXY_CT_SEQ_WINDOW (1u << 18)

/* Whether sequence number `seq` lies within PYPROXY_CT_SEQ_WINDOW of `ref`, either way (mod 2^32). */
static __always_inline int pyproxy_ct_seq_near(__u32 seq, __u32 ref)
{
	return seq - ref + PYPROXY_CT_SEQ_WINDOW <= 2 * PYPROXY_CT_SEQ_WINDOW;
}

/* The state after a packet in direction `dir` with TCP flags `tcp_flags` (0 for UDP). UDP's move from SYN_RECV to
 * ESTABLISHED depends on the flow's age, not on the packet: the callers' (pyproxy_ct_seen). */
static __always_inline void pyproxy_ct_next(__u8 dir, __u8 tcp_flags, __u8 *state, __u8 *flags)
{
	if (tcp_flags & PYPROXY_TCP_RST) {
		*state = PYPROXY_CT_ST_CLOSED;
		return;
	}
	if (tcp_flags & PYPROXY_TCP_FIN) {
		*flags |= dir == PYPROXY_CT_FORWARD ? PYPROXY_CT_F_FIN_FWD : PYPROXY_CT_F_FIN_REV;
		*state = (*flags & (PYPROXY_CT_F_FIN_FWD | PYPROXY_CT_F_FIN_REV)) ==
				 (PYPROXY_CT_F_FIN_FWD | PYPROXY_CT_F_FIN_REV)
			 ? PYPROXY_CT_ST_TIME_WAIT
			 : PYPROXY_CT_ST_CLOSING;
		return;
	}
	if (dir == PYPROXY_CT_REVERSE && *state == PYPROXY_CT_ST_NEW)
		*state = PYPROXY_CT_ST_SYN_RECV;
	/* The client's packet after the SYN-ACK, not a retransmitted SYN (a TCP packet: UDP has no flags). */
	else if (dir == PYPROXY_CT_FORWARD && *state == PYPROXY_CT_ST_SYN_RECV && tcp_flags &&
		 !(tcp_flags & PYPROXY_TCP_SYN))
		*state = PYPROXY_CT_ST_ESTABLISHED;
}

/* The direction of the client's own packets is FORWARD: for an entry of an SNAT pair, whose REVERSE entry
 * sees the client's packets (abi.h, PYPROXY_CT_F_SNAT), the other way round. */
static __always_inline __u8 pyproxy_ct_orig_dir(const struct pyproxy_ct_key *k, const struct pyproxy_ct_value *v)
{
	return v->flags & PYPROXY_CT_F_SNAT ? k->dir ^ 1 : k->dir;
}

/* The backend of the Service flow an entry belongs to: the FORWARD entry holds it, the REVERSE entry is keyed by
 * it (not for an SNAT pair's entries). */
static __always_inline void pyproxy_ct_backend(const struct pyproxy_ct_key *k, const struct pyproxy_ct_value *v,
					       struct pyproxy_backend *be)
{
	be->addr = k->dir == PYPROXY_CT_FORWARD ? v->nat_addr : k->saddr;
	be->port = k->dir == PYPROXY_CT_FORWARD ? v->nat_port : k->sport;
	be->pad = 0;
}

/* A flow counted in its backend's open flows (lc, sed, nq; abi.h PYPROXY_CT_F_COUNTED) ends: it closes, or goes
 * while still open. Called before the entry's state becomes one that is over, so a flow is uncounted once. */
static __always_inline void pyproxy_ct_uncount(const struct pyproxy_ct_key *k, const struct pyproxy_ct_value *v)
{
	struct pyproxy_backend be;

	if ((v->flags & (PYPROXY_CT_F_COUNTED | PYPROXY_CT_F_SNAT)) != PYPROXY_CT_F_COUNTED || pyproxy_ct_over(v->state))
		return;
	pyproxy_ct_backend(k, v, &be);
	pyproxy_active_add(&be, -1);
}

/* The address-independent half of a packet seen on an entry (both families): refreshes `*last_seen`, keeps
 * `*seq_end` (the RST window, above; `seq` and `end`: the segment's, pyproxy_tcp_end), and works out the flow's next
 * state and flags from the entry's (`dir`: the packet's direction as the client sees it). Returns whether they
 * change: never for a RST outside the window. */
static __always_inline int pyproxy_ct_advance(__u64 *last_seen, __u32 *seq_end, __u8 cur_state, __u8 cur_flags,
					      __u8 dir, __u8 tcp_flags, __u32 seq, __u32 end, __u64 now, __u8 *state,
					      __u8 *flags)
{
	/* Written once per tick, not per packet: a flow's packets on several CPUs then share the cache line. */
	if (*last_seen != now)
		*last_seen = now;
	if (cur_state == PYPROXY_CT_ST_NEW) {
		/* The sender's first segments (the backend's SYN-ACK for its entry; a retransmitted SYN for the
		 * client's) set its sequence, whatever it was: no RST is checked in NEW. */
		if (*seq_end != end)
			*seq_end = end;
	} else if (tcp_flags & PYPROXY_TCP_RST) {
		if (!(cur_flags & PYPROXY_CT_F_SEQ_UNKNOWN) && !pyproxy_ct_seq_near(seq, *seq_end)) {
			pyproxy_count(PYPROXY_CNT_CT_RST_IGNORED);
			return 0;
		}
	} else if ((__s32)(end - *seq_end) > 0 && pyproxy_ct_seq_near(seq, *seq_end)) {
		/* Data: the one store of the common packet, into the entry's own line (a pure ACK or UDP has none). */
		*seq_end = end;
	}
	/* The common packet changes nothing: no FIN or RST on a flow past its handshake. */
	if (!(tcp_flags & (PYPROXY_TCP_FIN | PYPROXY_TCP_RST)) && cur_state != PYPROXY_CT_ST_NEW &&
	    cur_state != PYPROXY_CT_ST_SYN_RECV)
		return 0;
	*state = cur_state;
	*flags = cur_flags;
	pyproxy_ct_next(dir, tcp_flags, state, flags);
	return *state != cur_state || *flags != cur_flags;
}

/* Whether entry `v` (under `k`) holds its flow's beginning itself (abi.h, pyproxy_ct_value.epoch): every entry but
 * a Service flow's FORWARD one, whose epoch field is the backends epoch. */
static __always_inline int pyproxy_ct_holds_born(__u8 dir, __u8 flags)
{
	return dir == PYPROXY_CT_REVERSE || (flags & PYPROXY_CT_F_SNAT);
}

/* A packet of a live flow passed in the direction of entry `v` (under key `k`): refresh its clock and move
 * the flow's state. A state change is written to the peer entry too (one more lookup, a few times per
 * connection), so both directions expire alike. A replied UDP flow pays the peer lookup on each packet of its
 * first seconds, for its age (pyproxy_ct_stream_due). */
static __always_inline void pyproxy_ct_seen(const struct pyproxy_ct_key *k, struct pyproxy_ct_value *v,
					    const struct pyproxy_pkt *p, __u64 now)
{
	__u8 state, flags;
	struct pyproxy_ct_value *peer = NULL;

	if (!pyproxy_ct_advance(&v->last_seen, &v->seq_end, v->state, v->flags, pyproxy_ct_orig_dir(k, v), p->tcp_flags,
				pyproxy_pkt_seq(&p->tcp_seq), pyproxy_pkt_end(&p->tcp_seq, p->l4_len, &p->tcp_hlen, p->tcp_flags), now, &state,
				&flags)) {
		if (v->state != PYPROXY_CT_ST_SYN_RECV || k->proto != IPPROTO_UDP)
			return;
		if (!pyproxy_ct_holds_born(k->dir, v->flags)) {
			peer = pyproxy_ct_peer(k, v);
			if (!peer || !pyproxy_ct_stream_due(peer->epoch, now))
				return;
		} else if (!pyproxy_ct_stream_due(v->epoch, now)) {
			return;
		}
		state = PYPROXY_CT_ST_ESTABLISHED;
		flags = v->flags;
	}
	if (pyproxy_ct_over(state))
		pyproxy_ct_uncount(k, v);
	v->state = state;
	v->flags = flags;
	if (!peer)
		peer = pyproxy_ct_peer(k, v);
	if (peer) {
		peer->state = state;
		peer->flags = (peer->flags & ~PYPROXY_CT_F_FLOW) | (flags & PYPROXY_CT_F_FLOW);
	}
}

/* The translation of a packet that follows a live flow's entry in direction `dir` (one carrying all of `flags`):
 * *to gets the entry's address and port, and the entry sees the packet. 0: no such entry. */
static __always_inline int pyproxy_ct_translate(const struct pyproxy_pkt *p, __u8 dir, __u8 flags,
						struct pyproxy_backend *to)
{
	struct pyproxy_ct_value *ct;
	struct pyproxy_ct_key k;
	__u64 now;

	pyproxy_ct_key_of(p, dir, &k);
	ct = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &k);
	if (!ct || (ct->flags & flags) != flags)
		return 0;
	now = pyproxy_now();
	if (!pyproxy_ct_live(&k, ct, now)) {
		pyproxy_count(PYPROXY_CNT_CT_EXPIRED);
		return 0;
	}
	to->addr = ct->nat_addr;
	to->port = ct->nat_port;
	to->pad = 0;
	pyproxy_ct_seen(&k, ct, p, now);
	return 1;
}

/* Removes the entry `v` under `k` and, when it is the other half of the same flow, its peer (the peer's key
 * may hold another live flow's entry, which stays). */
static __always_inline void pyproxy_ct_delete_pair(const struct pyproxy_ct_key *k, const struct pyproxy_ct_value *v)
{
	struct pyproxy_ct_key pk;

	pyproxy_ct_peer_key(k, v, &pk);
	if (pyproxy_ct_peer(k, v))
		bpf_map_delete_elem(&PYPROXY_MAP_CT, &pk);
	bpf_map_delete_elem(&PYPROXY_MAP_CT, k);
}

/* The key of the SNAT pair's REVERSE entry of the Service flow whose FORWARD entry `v` is under `k`: the client's
 * packets as they leave toward the backend. */
static __always_inline void pyproxy_ct_snat_key(const struct pyproxy_ct_key *k, const struct pyproxy_ct_value *v,
						struct pyproxy_ct_key *sk)
{
	pyproxy_ct_key_set(sk, k->saddr, v->nat_addr, k->sport, v->nat_port, k->proto, PYPROXY_CT_REVERSE);
}

/* Removes the SNAT pair whose REVERSE entry would put a node address on the packets client:cport -> be (snat.h), if
 * any: a new flow, through a frontend or straight to the backend, now has that tuple. A closed flow's pair stays
 * live until its timeout, and a TCP client reuses its port only after a close, so an old pair is what this finds.
 * Returns whether there was one. */
static __always_inline int pyproxy_ct_forget_snat(__be32 client, __be16 cport, const struct pyproxy_backend *be,
						  __u8 proto)
{
	struct pyproxy_ct_key sk;
	struct pyproxy_ct_value *sv;

	pyproxy_ct_key_set(&sk, client, be->addr, cport, be->port, proto, PYPROXY_CT_REVERSE);
	sv = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &sk);
	if (!sv || !(sv->flags & PYPROXY_CT_F_SNAT))
		return 0;
	pyproxy_ct_delete_pair(&sk, sv);
	return 1;
}

/* Removes a flow: the pair of `v` under `k` and, for a Service flow's FORWARD entry that has one, its SNAT pair,
 * so the node port it held is free at once. */
static __always_inline void pyproxy_ct_delete(const struct pyproxy_ct_key *k, const struct pyproxy_ct_value *v)
{
	struct pyproxy_ct_key sk;
	struct pyproxy_ct_value *sv;

	pyproxy_ct_uncount(k, v);
	if (k->dir == PYPROXY_CT_FORWARD && (v->flags & PYPROXY_CT_F_MASQ)) {
		pyproxy_ct_snat_key(k, v, &sk);
		sv = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &sk);
		if (sv && (sv->flags & PYPROXY_CT_F_SNAT))
			pyproxy_ct_delete_pair(&sk, sv);
	}
	pyproxy_ct_delete_pair(k, v);
}

/* Records both directions of a new flow: the forward entry for the client's later packets and the
 * reverse entry, keyed as the backend's replies will look, for reverse NAT. Returns non-zero when the
 * table refused (only possible under memory pressure: the LRU evicts rather than fills). */
static __always_inline int pyproxy_ct_create(const struct pyproxy_pkt *p, const struct pyproxy_backend *be,
					     __u32 svc_id, __u64 now, __u32 epoch, __u8 fwd_flags)
{
	struct pyproxy_ct_key fwd, rev;
	struct pyproxy_ct_value fv = {}, rv = {};
	__u8 state = PYPROXY_CT_ST_NEW, flags = 0;

	pyproxy_ct_next(PYPROXY_CT_FORWARD, p->tcp_flags, &state, &flags);
	pyproxy_ct_key_of(p, PYPROXY_CT_FORWARD, &fwd);
	fv.nat_addr = be->addr;
	fv.nat_port = be->port;
	fv.state = state;
	fv.flags = flags | fwd_flags;
	fv.svc_id = svc_id;
	fv.epoch = epoch;
	fv.last_seen = now;
	/* The client's SYN (the RST window); the backend's entry learns its own from the SYN-ACK. */
	fv.seq_end = pyproxy_pkt_end(&p->tcp_seq, p->l4_len, &p->tcp_hlen, p->tcp_flags);

	pyproxy_ct_peer_key(&fwd, &fv, &rev);
	rv.nat_addr = p->daddr;
	rv.nat_port = p->dport;
	rv.state = state;
	rv.flags = flags | (fwd_flags & PYPROXY_CT_F_COUNTED);
	rv.svc_id = svc_id;
	rv.epoch = (__u32)now;   /* the flow's beginning (abi.h) */
	rv.last_seen = now;

	/* Reverse first: a forward entry without its reverse would send replies out untranslated. */
	if (bpf_map_update_elem(&PYPROXY_MAP_CT, &rev, &rv, BPF_ANY))
		return -1;
	return bpf_map_update_elem(&PYPROXY_MAP_CT, &fwd, &fv, BPF_ANY);
}

/* Whether some endpoint listens on `port` (network order): PYPROXY_MAP_PORTS, an inlined array read. */
static __always_inline int pyproxy_endpoint_port(__be16 port)
{
	__u32 p = bpf_ntohs(port), word = p >> 6;
	__u64 *bits = bpf_map_lookup_elem(&PYPROXY_MAP_PORTS, &word);

	return bits && (*bits >> (p & 63)) & 1;
}

/* A packet that is no Service's, entering the node. If it may start a new flow to an endpoint (a TCP SYN, a
 * UDP datagram) and a Service flow's reverse entry has exactly its reply tuple, that entry would rewrite the
 * endpoint's replies to come from the frontend, and the client would drop them: the client has moved on to
 * talk to the endpoint directly from the same port (a TCP client only reuses a port after the connection
 * closed). The old flow goes, both entries, so its next packet to the frontend starts a new one. Non-Service
 * traffic pays an array read for this; a hash lookup only when its destination port is an endpoint's. */
static __always_inline void pyproxy_ct_untrack(const struct pyproxy_pkt *p)
{
	struct pyproxy_backend to = { .addr = p->daddr, .port = p->dport };
	struct pyproxy_ct_key k;
	struct pyproxy_ct_value *v;
	int gone;

	if (p->proto == IPPROTO_TCP ? !pyproxy_is_syn(p) : p->proto != IPPROTO_UDP)
		return;
	if (!pyproxy_endpoint_port(p->dport))
		return;
	pyproxy_ct_key_set(&k, p->daddr, p->saddr, p->dport, p->sport, p->proto, PYPROXY_CT_REVERSE);
	v = bpf_map_lookup_elem(&PYPROXY_MAP_CT, &k);
	/* An SNAT pair's REVERSE entry has the tuple of the client's packets to the backend, whose replies, once
	 * given their client back, look like such a packet: they are the flow itself. */
	gone = v && !(v->flags & PYPROXY_CT_F_SNAT);
	if (gone)
		pyproxy_ct_delete(&k, v);
	/* The old flow, if SNATed, also left a pair that would put a node address on this connection's packets
	 * (and a flow the LRU or a new flow's entries half replaced may have left only that pair). */
	gone |= pyproxy_ct_forget_snat(p->saddr, p->sport, &to, p->proto);
	if (gone)
		pyproxy_count(PYPROXY_CNT_CT_UNTRACKED);
}

#endif
