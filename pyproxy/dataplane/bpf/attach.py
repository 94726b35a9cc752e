"""Attaching pyproxy's programs to devices: TC clsact filters and XDP, through libbpf.

libbpf rather than pyroute2 here because it also answers "which program is attached" (bpf_tc_query,
bpf_xdp_query_id), which a restart needs to find the previous run's maps. Our TC filter always sits at one
fixed priority and handle, so a restart replaces it atomically and cleanup finds it without guessing.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from typing import Any

from pyproxy.dataplane import netlink
from pyproxy.dataplane.bpf import abi, libbpf, loader
from pyproxy.dataplane.bpf.libbpf import ffi

log = logging.getLogger(__name__)

INGRESS = 1  # BPF_TC_INGRESS
EGRESS = 2  # BPF_TC_EGRESS
TC_PRIORITY = 0x7079  # "py": our filter's priority on both hooks
TC_HANDLE = 1
BPF_TC_F_REPLACE = 1

XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
XDP_MODES = {"native": XDP_FLAGS_DRV_MODE, "generic": XDP_FLAGS_SKB_MODE}

# The hooks of a device pyproxy may hold a program on, by the name logs use.
TC_HOOKS = {"tc ingress": INGRESS, "tc egress": EGRESS}
XDP_HOOKS = {f"XDP ({mode})": mode for mode in XDP_MODES}


def _hook(ifindex: int, direction: int) -> Any:
    hook = ffi.new("struct bpf_tc_hook *")
    hook.sz = ffi.sizeof("struct bpf_tc_hook")
    hook.ifindex = ifindex
    hook.attach_point = direction
    return hook


def _opts(prog_fd: int = 0, flags: int = 0) -> Any:
    opts = ffi.new("struct bpf_tc_opts *")
    opts.sz = ffi.sizeof("struct bpf_tc_opts")
    opts.handle = TC_HANDLE
    opts.priority = TC_PRIORITY
    opts.prog_fd = prog_fd
    opts.flags = flags
    return opts


def attach_tc(ifindex: int, direction: int, prog_fd: int) -> None:
    """Put (or atomically replace) our filter on one hook, creating the clsact qdisc if missing."""
    lib = libbpf.lib()
    if not netlink.has_clsact(ifindex):
        ret = lib.bpf_tc_hook_create(_hook(ifindex, direction))
        if ret != -errno.EEXIST:
            libbpf.check(ret, f"create clsact on ifindex {ifindex}")
    libbpf.check(
        lib.bpf_tc_attach(_hook(ifindex, direction), _opts(prog_fd, BPF_TC_F_REPLACE)),
        f"attach tc program on ifindex {ifindex}",
    )


def tc_prog_id(ifindex: int, direction: int) -> int | None:
    """The id of the program in our filter slot, or None when the slot is empty."""
    if not netlink.has_clsact(ifindex):
        return None  # querying would only make libbpf print "Parent Qdisc doesn't exists"
    opts = _opts()
    ret = libbpf.lib().bpf_tc_query(_hook(ifindex, direction), opts)
    if ret < 0:
        return None
    return int(opts.prog_id)


def detach_tc(ifindex: int, direction: int) -> bool:
    """Remove our filter from one hook; True if there was one."""
    ret = libbpf.lib().bpf_tc_detach(_hook(ifindex, direction), _opts())
    if ret in (-errno.ENOENT, -errno.EINVAL, -errno.ENODEV):
        return False
    libbpf.check(ret, f"detach tc program from ifindex {ifindex}")
    return True


def attach_xdp(ifindex: int, prog_fd: int, mode: str) -> None:
    """Attach in `mode`; a refusal's OSError carries the kernel's reason where it gave one (a driver's limit:
    "veth: Peer MTU is too large to set XDP"), which the bare errno (ERANGE, EINVAL) does not tell."""
    lib = libbpf.lib()
    libbpf.take_kernel_message()
    ret = lib.bpf_xdp_attach(ifindex, prog_fd, XDP_MODES[mode], ffi.NULL)
    if ret < 0:
        reason = libbpf.take_kernel_message()
        code = -ret if ret != -1 else ffi.errno
        raise OSError(code, f"attach XDP ({mode}) on ifindex {ifindex}: {os.strerror(code)}"
                            + (f" ({reason})" if reason else ""))


def xdp_prog_ids(ifindex: int) -> dict[str, int]:
    """Attached XDP program ids by mode ("native", "generic")."""
    out = {}
    for mode, flag in XDP_MODES.items():
        pid = ffi.new("uint32_t *")
        if libbpf.lib().bpf_xdp_query_id(ifindex, flag, pid) == 0 and pid[0]:
            out[mode] = int(pid[0])
    return out


def detach_xdp(ifindex: int, mode: str) -> None:
    libbpf.check(libbpf.lib().bpf_xdp_detach(ifindex, XDP_MODES[mode], ffi.NULL), f"detach XDP from {ifindex}")


def ours(ifindex: int) -> dict[str, int]:
    """pyproxy's programs on one device: hook (a TC_HOOKS or XDP_HOOKS name) -> program id."""
    found = {hook: tc_prog_id(ifindex, direction) for hook, direction in TC_HOOKS.items()}
    found |= {f"XDP ({mode})": pid for mode, pid in xdp_prog_ids(ifindex).items()}
    return {hook: pid for hook, pid in found.items() if pid and loader.is_ours(pid)}


def detach(ifindex: int, hooks: Iterable[str] | None = None) -> list[str]:
    """Remove pyproxy's programs from `hooks` (default: all) of one device, and the clsact qdisc once no
    filter is left on it; the hooks a program was removed from."""
    wanted = set(TC_HOOKS) | set(XDP_HOOKS) if hooks is None else set(hooks)
    removed = []
    for hook in ours(ifindex).keys() & wanted:
        if hook in TC_HOOKS:
            if not detach_tc(ifindex, TC_HOOKS[hook]):
                continue
        else:
            detach_xdp(ifindex, XDP_HOOKS[hook])
        removed.append(hook)
    if any(h in TC_HOOKS for h in removed) and netlink.has_clsact(ifindex) and netlink.tc_filter_count(ifindex) == 0:
        netlink.remove_clsact(ifindex)
    return sorted(removed, key=list(TC_HOOKS | XDP_HOOKS).index)


KERNEL_NAME_LEN = 15  # BPF_OBJ_NAME_LEN - 1: what the kernel keeps of a map's name ("pyproxy_epoch_v1" -> "…_v")


def abi_map_name(kernel_name: str) -> str | None:
    """The abi.ALL_MAPS name of a map as the kernel names it (cut to 15 characters), or None if not ours."""
    return next((n for n in abi.ALL_MAPS if n[:KERNEL_NAME_LEN] == kernel_name), None)


def maps_in_use() -> dict[str, int]:
    """abi name -> a new fd (the caller's), for every pyproxy map that pyproxy's programs attached to this
    namespace's devices hold: what a restart adopts and `pyproxy inspect` reads when no pins are reachable
    (under `ip netns exec`, each invocation's /sys is its own). Maps no program uses (the names map) are
    not among them."""
    found: dict[str, int] = {}
    for pid in sorted({pid for link in netlink.list_links() for pid in ours(link.index).values()}):
        _add_maps_of(pid, found)
    # The IPv6 maps are held by the IPv6 programs, which only the program arrays of the attached ones name.
    for pid in jumped_to(found):
        _add_maps_of(pid, found)
    return found


def _add_maps_of(pid: int, found: dict[str, int]) -> None:
    for kernel_name, fd in loader.maps_of_program(pid).items():
        name = abi_map_name(kernel_name)
        if name is None or name in found:
            os.close(fd)
        else:
            found[name] = fd


def jumped_to(maps: dict[str, int]) -> list[int]:
    """The ids of the programs in the IPv6 program arrays among `maps` (abi name -> fd): a program array read from
    user space gives its programs' ids."""
    lib, ids = libbpf.lib(), []
    for name, jumps in abi.JUMPS6.items():
        if name not in maps:
            continue
        for index in jumps:
            key, value = ffi.new("uint32_t *", index), ffi.new("uint32_t *")
            if lib.bpf_map_lookup_elem(maps[name], key, value) == 0 and value[0]:
                ids.append(int(value[0]))
    return ids
