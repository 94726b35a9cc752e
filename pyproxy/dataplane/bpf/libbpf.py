"""libbpf through cffi (ABI mode: dlopen of Debian's libbpf.so.1, nothing compiled at install time).

Only the calls pyproxy uses are declared. Every wrapper turns libbpf's negative-errno convention into an
OSError that names what failed.
"""

from __future__ import annotations

import errno
import os
import struct
import sys
import threading
from typing import Any

from cffi import FFI

ffi = FFI()
ffi.cdef(
    """
    struct bpf_object; struct bpf_map; struct bpf_program;

    struct bpf_test_run_opts {
        size_t sz;
        const void *data_in;
        void *data_out;
        uint32_t data_size_in;
        uint32_t data_size_out;
        const void *ctx_in;
        void *ctx_out;
        uint32_t ctx_size_in;
        uint32_t ctx_size_out;
        uint32_t retval;
        int repeat;
        uint32_t duration;
        uint32_t flags;
        uint32_t cpu;
        uint32_t batch_size;
    };

    struct bpf_tc_hook { size_t sz; int ifindex; int attach_point; uint32_t parent; };
    struct bpf_tc_opts { size_t sz; int prog_fd; uint32_t flags; uint32_t prog_id; uint32_t handle;
                         uint32_t priority; };
    int bpf_tc_hook_create(struct bpf_tc_hook *hook);
    int bpf_tc_hook_destroy(struct bpf_tc_hook *hook);
    int bpf_tc_attach(const struct bpf_tc_hook *hook, struct bpf_tc_opts *opts);
    int bpf_tc_detach(const struct bpf_tc_hook *hook, const struct bpf_tc_opts *opts);
    int bpf_tc_query(const struct bpf_tc_hook *hook, struct bpf_tc_opts *opts);
    int bpf_xdp_attach(int ifindex, int prog_fd, uint32_t flags, const void *opts);
    int bpf_xdp_detach(int ifindex, uint32_t flags, const void *opts);
    int bpf_xdp_query_id(int ifindex, int flags, uint32_t *prog_id);
    uint32_t bpf_map__key_size(const struct bpf_map *map);
    uint32_t bpf_map__value_size(const struct bpf_map *map);
    uint32_t bpf_map__max_entries(const struct bpf_map *map);
    int bpf_map__type(const struct bpf_map *map);
    uint32_t bpf_map__map_flags(const struct bpf_map *map);

    struct bpf_object *bpf_object__open_file(const char *path, const void *opts);
    int bpf_object__load(struct bpf_object *obj);
    void bpf_object__close(struct bpf_object *obj);
    struct bpf_map *bpf_object__next_map(const struct bpf_object *obj, const struct bpf_map *map);
    struct bpf_program *bpf_object__next_program(const struct bpf_object *obj, struct bpf_program *prog);
    const char *bpf_map__name(const struct bpf_map *map);
    int bpf_map__set_pin_path(struct bpf_map *map, const char *path);
    int bpf_map__reuse_fd(struct bpf_map *map, int fd);
    int bpf_map__set_max_entries(struct bpf_map *map, uint32_t max_entries);
    int bpf_map__fd(const struct bpf_map *map);
    void *bpf_map__initial_value(struct bpf_map *map, size_t *psize);
    _Bool bpf_map__is_internal(const struct bpf_map *map);
    int bpf_map__set_initial_value(struct bpf_map *map, const void *data, size_t size);
    const char *bpf_program__name(const struct bpf_program *prog);
    int bpf_program__fd(const struct bpf_program *prog);

    int bpf_map_update_elem(int fd, const void *key, const void *value, uint64_t flags);
    int bpf_map_lookup_elem(int fd, const void *key, void *value);
    int bpf_map_delete_elem(int fd, const void *key);
    int bpf_map_get_next_key(int fd, const void *key, void *next_key);
    struct bpf_map_batch_opts { size_t sz; uint64_t elem_flags; uint64_t flags; };
    int bpf_map_update_batch(int fd, const void *keys, const void *values, uint32_t *count,
                             const struct bpf_map_batch_opts *opts);
    int bpf_map_delete_batch(int fd, const void *keys, uint32_t *count, const struct bpf_map_batch_opts *opts);
    int bpf_map_lookup_batch(int fd, void *in_batch, void *out_batch, void *keys, void *values, uint32_t *count,
                             const struct bpf_map_batch_opts *opts);
    int bpf_obj_get(const char *pathname);
    int bpf_obj_pin(int fd, const char *pathname);
    int bpf_link_create(int prog_fd, int target_fd, int attach_type, const void *opts);
    int bpf_iter_create(int link_fd);
    int bpf_link_update(int link_fd, int new_prog_fd, const void *opts);
    int bpf_map_get_fd_by_id(uint32_t id);
    struct bpf_map_create_opts { size_t sz; uint32_t btf_fd; uint32_t btf_key_type_id; uint32_t btf_value_type_id;
                                 uint32_t btf_vmlinux_value_type_id; uint32_t inner_map_fd; uint32_t map_flags;
                                 uint64_t map_extra; uint32_t numa_node; uint32_t map_ifindex; };
    int bpf_map_create(int map_type, const char *map_name, uint32_t key_size, uint32_t value_size,
                       uint32_t max_entries, const struct bpf_map_create_opts *opts);
    int bpf_prog_get_fd_by_id(uint32_t id);
    int bpf_prog_get_next_id(uint32_t start_id, uint32_t *next_id);
    int bpf_obj_get_info_by_fd(int bpf_fd, void *info, uint32_t *info_len);
    int bpf_prog_test_run_opts(int prog_fd, struct bpf_test_run_opts *opts);
    int libbpf_num_possible_cpus(void);

    struct bpf_prog_load_opts { size_t sz; int attempts; int expected_attach_type; uint32_t prog_btf_fd;
                                uint32_t prog_flags; uint32_t prog_ifindex; uint32_t kern_version;
                                uint32_t attach_btf_id; uint32_t attach_prog_fd; uint32_t attach_btf_obj_fd;
                                const int *fd_array; const void *func_info; uint32_t func_info_cnt;
                                uint32_t func_info_rec_size; const void *line_info; uint32_t line_info_cnt;
                                uint32_t line_info_rec_size; uint32_t log_level; uint32_t log_size; char *log_buf; };
    int bpf_prog_load(int prog_type, const char *prog_name, const char *license, const void *insns,
                      size_t insn_cnt, const struct bpf_prog_load_opts *opts);
    int libbpf_probe_bpf_prog_type(int prog_type, const void *opts);
    int libbpf_probe_bpf_map_type(int map_type, const void *opts);

    /* libbpf_print_fn_t; its va_list declared as the pointer it is passed as (x86-64 and arm64 alike), for
       vsnprintf of the C library. */
    typedef int (*libbpf_print_fn_t)(int level, const char *fmt, void *args);
    libbpf_print_fn_t libbpf_set_print(libbpf_print_fn_t fn);
    int vsnprintf(char *str, size_t size, const char *format, void *args);
    """
)

_lib: Any = None
_libc: Any = None
LIBBPF_WARN, LIBBPF_INFO = 0, 1
KERNEL_MESSAGE = "Kernel error message: "
_kernel_message = threading.local()


@ffi.callback("int(int, const char *, void *)")
def _print(level: int, fmt: Any, args: Any) -> int:
    """libbpf's printer: what libbpf's own prints (warnings and information, to stderr), but that a netlink
    call's reason from the kernel (the extended ack: "veth: Peer MTU is too large to set XDP") is also kept
    for the calling thread, so the OSError of that call can say why (last_kernel_message)."""
    if level > LIBBPF_INFO:
        return 0
    buf = ffi.new("char[4096]")
    _libc.vsnprintf(buf, len(buf), fmt, args)
    text = ffi.string(buf).decode(errors="replace")
    if KERNEL_MESSAGE in text:
        _kernel_message.text = text.split(KERNEL_MESSAGE, 1)[1].strip()
    sys.stderr.write(text)
    return 0


def take_kernel_message() -> str | None:
    """The kernel's reason for this thread's last failed netlink call through libbpf, once (None when it gave
    none)."""
    text = getattr(_kernel_message, "text", None)
    _kernel_message.text = None
    return text


def lib() -> Any:
    """The loaded libbpf; opened on first use so importing pyproxy never needs it."""
    global _lib
    if _lib is None:
        try:
            lib = ffi.dlopen("libbpf.so.1")
        except OSError as e:
            raise OSError(errno.ENOENT, f"libbpf.so.1 not found (install Debian's libbpf1): {e}") from e
        global _libc
        _libc = ffi.dlopen(None)
        lib.libbpf_set_print(_print)
        _lib = lib
    return _lib


def check(ret: int, what: str) -> int:
    """libbpf returns -errno (and sets errno); raise an OSError naming the operation."""
    if ret < 0:
        code = -ret if ret != -1 else ffi.errno
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return ret


BPF_ANY = 0
BPF_NOEXIST = 1
BPF_EXIST = 2


# Contexts for bpf_prog_test_run_opts.ctx_in (tests and benchmarks): a test run's packet arrives on no device
# unless its context names one, and SNAT's route lookup (snat.h) starts from the device it arrived on.
def skb_ctx(ingress_ifindex: int, ifindex: int) -> bytes:
    """The head of a struct __sk_buff up to `ifindex`: the device the packet arrived on (ingress_ifindex, at offset
    36) and the one it is on; the rest zero, as the kernel wants."""
    return bytes(36) + struct.pack("=II", ingress_ifindex, ifindex)


def xdp_ctx(size: int, ingress_ifindex: int) -> bytes:
    """A struct xdp_md for a `size`-byte frame (data 0, data_end size, no metadata) arriving on `ingress_ifindex`."""
    return struct.pack("=IIII", 0, size, 0, ingress_ifindex)

