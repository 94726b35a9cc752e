/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Stands in for libbpf's <bpf/bpf_helpers.h> when BCC compiles bpf/ (--bpf-loader=bcc; only BCC's include path has
 * bpf/bcc/). BCC declares the helpers itself (its helpers.h, included before any source), under the same names as
 * libbpf: including libbpf's header too would declare each twice. What is left for the sources is SEC().
 */
#ifndef PYPROXY_BCC_BPF_HELPERS_H
#define PYPROXY_BCC_BPF_HELPERS_H

/* BCC puts each program in a section of its own and takes the program type from the loader, not from a section
 * name; a second section attribute would fight its own. The license is BCC's too (bcc.h: BPF_LICENSE). */
#define SEC(name)

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif

#endif
