// SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0)
/* The machine's floor for per-packet work: an XDP program that only returns a verdict. Benchmarks
 * divide pyproxy's cost by this one's, measured in the same run. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int pyproxy_verdict(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
