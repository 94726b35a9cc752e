/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Stands in for libbpf's <bpf/bpf_endian.h> under BCC (see bpf_helpers.h here): the same four conversions. */
#ifndef PYPROXY_BCC_BPF_ENDIAN_H
#define PYPROXY_BCC_BPF_ENDIAN_H

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define bpf_htons(x) ((__be16)__builtin_bswap16(x))
#define bpf_ntohs(x) ((__u16)__builtin_bswap16(x))
#define bpf_htonl(x) ((__be32)__builtin_bswap32(x))
#define bpf_ntohl(x) ((__u32)__builtin_bswap32(x))
#else
#define bpf_htons(x) ((__be16)(x))
#define bpf_ntohs(x) ((__u16)(x))
#define bpf_htonl(x) ((__be32)(x))
#define bpf_ntohl(x) ((__u32)(x))
#endif

#endif
