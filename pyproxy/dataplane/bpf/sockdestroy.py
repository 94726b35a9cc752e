"""Moving the node's connected UDP sockets off endpoints that left: bpf/sockdestroy.bpf.c's iterator (kernel 6.5).

A connected UDP socket the socket hooks pointed at a backend keeps that backend's address for its life; the packet
path moves a flow whose endpoint left at its next datagram. After a sync that removed endpoints (the backends epoch
moved), BpfDataplane runs the iterator over its network namespace's UDP sockets, which destroys each one pointed at
a backend that is no longer an endpoint (its owner's next call fails with ECONNABORTED, as Cilium does). Kernels
before 6.5 lack bpf_sock_destroy: the object does not load there, the start logs it once, and such sockets keep
their endpoint (a pod's UDP is TC's on every kernel: ServicePortState.pods_at_socket).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from pyproxy.dataplane.bpf import abi, libbpf, loader
from pyproxy.dataplane.bpf.errors import BpfUnavailable
from pyproxy.dataplane.bpf.libbpf import ffi

log = logging.getLogger(__name__)

BPF_TRACE_ITER = 28
"""enum bpf_attach_type (uapi/linux/bpf.h)."""
COOKIE_BYTES = 8
"""What the iterator writes per socket it destroyed: its cookie."""


class SocketDestroyer:
    """The loaded iterator, on the datapath's own maps."""

    def __init__(self, obj: loader.LoadedObject) -> None:
        self._obj = obj
        self._link = libbpf.check(libbpf.lib().bpf_link_create(obj.progs[abi.PROG_UDP_DESTROY], 0, BPF_TRACE_ITER,
                                                               ffi.NULL), "create the UDP socket iterator's link")

    @classmethod
    def load(cls, path: Path, maps: Mapping[str, int]) -> SocketDestroyer:
        """Load `path` on the datapath's maps (`maps`: name -> fd, adopted at their sizes). BpfUnavailable when the
        kernel refuses it (before 6.5: no bpf_sock_destroy) or would give it maps of its own."""
        sizes = {name: loader.map_info(fd).max_entries for name, fd in maps.items()}
        obj = loader.load(path, None, sizes, adopt=dict(maps))
        try:
            for name in abi.DESTROY_MAPS:
                if loader.map_info(obj.maps[name]).id != loader.map_info(maps[name]).id:
                    raise BpfUnavailable(f"{path} did not get the datapath's own {name}")
            return cls(obj)
        except BaseException:
            obj.close()
            raise

    def run(self) -> int:
        """One pass over the UDP sockets of the calling thread's network namespace: how many were destroyed."""
        fd = libbpf.check(libbpf.lib().bpf_iter_create(self._link), "start the UDP socket iterator")
        try:
            out = 0
            while chunk := os.read(fd, 4096):
                out += len(chunk)
        finally:
            os.close(fd)
        return out // COOKIE_BYTES

    def close(self) -> None:
        os.close(self._link)
        self._obj.close()
