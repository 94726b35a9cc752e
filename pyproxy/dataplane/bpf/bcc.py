"""Loading bpf/ with BCC (--bpf-loader=bcc): the same sources compiled at start, the same maps, the same programs.

For nodes where the prebuilt object (bpf/build/pyproxy.bpf.o, `make bpf`) does not fit: BCC compiles
bpf/pyproxy.bpf.c in this process against the kernel headers it is given and loads the programs. The rest of
pyproxy sees what the libbpf loader gives (loader.LoadedObject: map and program fds by name), so the maps are the
same maps (names, layouts, pins under the same pin path: switching loaders keeps every flow) and the programs are
attached the same way.

BCC's frontend knows neither libbpf's BTF map definitions nor .rodata; bpf/include/pyproxy/bcc.h says how the
sources serve both, in two compiles: the maps (BCC creates or opens the pins), then the programs with each map's
fd and the programs' constants as -D flags. What BCC 0.26 cannot compile as libbpf's build does, and what the BCC
build does instead, is in bcc.h and the README ("The BCC loader").

BCC is Debian's libbpfcc (python3-bpfcc depends on it; PyPI's `bcc` is another thing), called through ctypes like
its own Python module does; it needs a kernel headers tree (BCC_KERNEL_SOURCE; `make install-bcc` installs
Debian's 6.1 headers, merged, at DEFAULT_KERNEL_SOURCE). `missing()` says what is not there.
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pyproxy.dataplane.bpf import abi, libbpf, loader

log = logging.getLogger(__name__)

BPF_DIR = Path(__file__).resolve().parents[3] / "bpf"
"""The sources BCC compiles: bpf/pyproxy.bpf.c and bpf/include (bpf/bcc: stand-ins for libbpf's headers)."""
DEFAULT_KERNEL_SOURCE = Path("/usr/local/lib/pyproxy/linux-headers")
"""Where `make install-bcc` puts the kernel headers; BCC_KERNEL_SOURCE names another tree."""
LIBBCC = "libbcc.so.0"

# uapi enum bpf_prog_type
_SCHED_CLS, _XDP, _CGROUP_SOCK, _CGROUP_SOCK_ADDR = 3, 6, 9, 18
_BPF_XDP = 37  # uapi enum bpf_attach_type: what libbpf gives SEC("xdp") programs
PROGRAMS = {
    abi.PROG_TC_INGRESS: (_SCHED_CLS, 0),
    abi.PROG_TC_EGRESS: (_SCHED_CLS, 0),
    # BPF_XDP as libbpf's: a program array (MAP_XJUMP6) takes only programs of its owner's expected attach type
    # (6.18), and a pinned one outlives a switch of loader.
    abi.PROG_XDP: (_XDP, _BPF_XDP),
    abi.PROG_TC_INGRESS6: (_SCHED_CLS, 0),
    abi.PROG_TC_EGRESS6: (_SCHED_CLS, 0),
    abi.PROG_XDP6: (_XDP, _BPF_XDP),
    **{name: (_CGROUP_SOCK_ADDR, attach_type) for name, attach_type in abi.SOCK_HOOKS.items()},
    abi.PROG_RELEASE: (_CGROUP_SOCK, abi.SOCK_HOOKS[abi.PROG_RELEASE]),
}
"""Program name -> (program type, expected attach type): what libbpf takes from each SEC() name."""
LOG_SIZE = 1 << 20
"""Bytes of the verifier's log kept for a program the kernel refuses: its last lines go in the error."""


class BccUnavailable(loader.BpfUnavailable):
    """BCC, the kernel headers it compiles against, or the sources are missing; says which and how to install."""


def kernel_source() -> Path:
    return Path(os.environ.get("BCC_KERNEL_SOURCE") or DEFAULT_KERNEL_SOURCE)


def missing() -> str | None:
    """What the BCC loader lacks here, or None. Checked before anything is changed."""
    try:
        ctypes.CDLL(LIBBCC)
    except OSError:
        return (f"BCC is not installed ({LIBBCC} not found): install Debian's python3-bpfcc, "
                f"e.g. `make install-bcc`")
    kdir = kernel_source()
    for need in ("include/linux/kconfig.h", "include/generated/autoconf.h", "arch/*/include/generated"):
        if not any(kdir.glob(need)):
            how = "BCC_KERNEL_SOURCE" if os.environ.get("BCC_KERNEL_SOURCE") else "default"
            return (f"no kernel headers for BCC at {kdir} ({how}; {need} missing): `make install-bcc` installs "
                    f"them, or set BCC_KERNEL_SOURCE to a kernel headers tree")
    if not (BPF_DIR / "pyproxy.bpf.c").exists():
        return f"the BPF sources are not at {BPF_DIR} (bpf/pyproxy.bpf.c)"
    return None


_lib: ctypes.CDLL | None = None


def _bcc() -> ctypes.CDLL:
    """libbcc with the calls used here declared (bcc_common.h, as BCC's own libbcc.py declares them)."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(LIBBCC, use_errno=True)
        vp, u64, cp = ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_char_p
        for name, res, args in (
            ("bpf_module_create_c", vp, [cp, ctypes.c_uint, ctypes.POINTER(cp), ctypes.c_int, ctypes.c_bool, cp]),
            ("bpf_module_destroy", None, [vp]),
            ("bpf_module_license", cp, [vp]),
            ("bpf_module_kern_version", ctypes.c_uint, [vp]),
            ("bpf_function_start", vp, [vp, cp]),
            ("bpf_function_size", ctypes.c_size_t, [vp, cp]),
            ("bpf_num_tables", u64, [vp]),
            ("bpf_table_name", cp, [vp, u64]),
            ("bpf_table_fd_id", ctypes.c_int, [vp, u64]),
            ("bpf_table_type_id", ctypes.c_int, [vp, u64]),
            ("bpf_table_max_entries_id", u64, [vp, u64]),
            ("bpf_table_flags_id", ctypes.c_int, [vp, u64]),
            ("bpf_table_key_size_id", u64, [vp, u64]),
            ("bpf_table_leaf_size_id", u64, [vp, u64]),
            ("bcc_func_load", ctypes.c_int, [vp, ctypes.c_int, cp, vp, ctypes.c_size_t, cp, ctypes.c_uint,
                                             ctypes.c_int, cp, ctypes.c_uint, cp, ctypes.c_uint]),
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _lib = lib
    return _lib


class Module:
    """One BCC compile of a source file (a `struct bpf_module`): destroyed with its tables' fds by `close()`.

    BCC looks every include up in the working directory before the include path (a ./pyproxy/abi.h there is what
    would be compiled in: seen here), so the compile runs in bpf/bcc, which holds only BCC's stand-ins. The
    dataplane starts before pyproxy starts any thread that could mind."""

    def __init__(self, source: Path, cflags: list[str], what: str) -> None:
        os.environ["BCC_KERNEL_SOURCE"] = str(kernel_source())  # read by libbcc at each compile
        args = [f.encode() for f in cflags]
        started = time.monotonic()
        here = os.getcwd()
        os.chdir(BPF_DIR / "bcc")
        try:
            with _stderr_to_log(f"compiling {what}") as failed:
                self.handle = _bcc().bpf_module_create_c(str(source).encode(), 0,
                                                         (ctypes.c_char_p * len(args))(*args), len(args), True, None)
                if not self.handle:
                    failed.append(1)
        finally:
            os.chdir(here)
        if not self.handle:
            raise BccUnavailable(f"BCC could not compile {what} (its messages are logged above)")
        log.info("BCC compiled %s in %.1f s", what, time.monotonic() - started)

    def tables(self) -> dict[str, tuple[int, tuple[int, int, int, int, int]]]:
        """Table name -> (fd, (type, key size, value size, max entries, flags)) as the declaration asked."""
        lib, m = _bcc(), self.handle
        return {
            lib.bpf_table_name(m, i).decode(): (
                lib.bpf_table_fd_id(m, i),
                (lib.bpf_table_type_id(m, i), lib.bpf_table_key_size_id(m, i), lib.bpf_table_leaf_size_id(m, i),
                 lib.bpf_table_max_entries_id(m, i), lib.bpf_table_flags_id(m, i)),
            )
            for i in range(lib.bpf_num_tables(m))
        }

    def load(self, name: str, prog_type: int, attach_type: int) -> int:
        """The program's fd; BpfUnavailable with the end of the verifier's log when the kernel refuses it."""
        lib, m, fn = _bcc(), self.handle, name.encode()
        start = lib.bpf_function_start(m, fn)
        if not start:
            raise BccUnavailable(f"BCC's compile of {BPF_DIR / 'pyproxy.bpf.c'} has no program {name}")
        buf = ctypes.create_string_buffer(LOG_SIZE)
        with _stderr_to_log(f"loading {name}") as failed:
            fd = lib.bcc_func_load(m, prog_type, fn, start, lib.bpf_function_size(m, fn), lib.bpf_module_license(m),
                                   lib.bpf_module_kern_version(m), 0, buf, len(buf), None, attach_type)
            code = ctypes.get_errno()
            if fd < 0:
                failed.append(1)
        if fd < 0:
            tail = "\n".join(buf.value.decode(errors="replace").strip().splitlines()[-4:])
            raise loader.BpfUnavailable(f"the kernel refused BCC's {name}: {os.strerror(code)}\n{tail}")
        return int(fd)

    def close(self) -> None:
        if self.handle:
            _bcc().bpf_module_destroy(self.handle)
            self.handle = None


@contextmanager
def _stderr_to_log(what: str, level: int = logging.DEBUG) -> Iterator[list[int]]:
    """libbcc prints clang's diagnostics and its own complaints to fd 2: into the log instead, as one record, at
    `level`, or at WARNING when the caller appends anything to the yielded list (it failed: the messages say why)."""
    failed: list[int] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 2)
        try:
            yield failed
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            out.seek(0)
            text = out.read().decode(errors="replace").strip()
            if text:
                log.log(logging.WARNING if failed else level, "BCC, %s:\n%s", what, text)


def _config_initializer(value: ctypes.Structure) -> str:
    """A C designated initializer of a ctypes struct mirror (abi.Config): bcc.h's PYPROXY_BCC_CONFIG. Network-order
    fields are held as the integer whose memory bytes are in network order: written back as that integer, the
    struct gets the same bytes."""
    parts = []
    for name, *_ in value._fields_:
        v = getattr(value, name)
        if isinstance(v, ctypes.Structure):
            parts.append(f".{name}={_config_initializer(v)}")
        elif isinstance(v, ctypes.Array):
            parts.append(f".{name}={{{','.join(str(int(x)) for x in v)}}}")
        else:
            parts.append(f".{name}={int(v)}")
    return "{" + ",".join(parts) + "}"


def _cflags() -> list[str]:
    return [
        "-DPYPROXY_BCC",
        f"-I{BPF_DIR / 'include'}",
        f"-I{BPF_DIR / 'bcc'}",
        # BCC's helper prototypes take `void *` where libbpf's take `const void *`.
        "-Wno-incompatible-pointer-types-discards-qualifiers",
    ]


class BccObject:
    """The handle of a BCC load: its two modules and the programs' fds (the maps' fds are the first module's)."""

    def __init__(self) -> None:
        self.modules: list[Module] = []
        self.prog_fds: list[int] = []

    def close(self) -> None:
        for fd in self.prog_fds:
            os.close(fd)
        self.prog_fds.clear()
        for m in reversed(self.modules):
            m.close()
        self.modules.clear()


def _compatible(fd: int, want: tuple[int, int, int, int, int]) -> bool:
    info = loader.map_info(fd)
    return (info.type, info.key_size, info.value_size, info.max_entries, info.map_flags) == want


def _maps(pin_dir: Path | None, max_entries: dict[str, int] | None, adopt: dict[str, int] | None) -> Module:
    """Step 1 (bcc.h): BCC creates each map or opens its pin. A pin (or an adopted map, pinned for BCC to open) of
    another shape than the declaration is replaced, as the libbpf loader replaces one: once, then compiled again."""
    flags = [*_cflags(), "-DPYPROXY_BCC_TABLES"]
    short = {name: s for s, name in abi.RESIZABLE.items()}
    flags += [f"-DPYPROXY_BCC_MAX_{short[name]}={n}" for name, n in (max_entries or {}).items()]
    if pin_dir is not None:
        flags.append(f'-DPYPROXY_BCC_PIN_DIR="{pin_dir}"')
        for name, fd in (adopt or {}).items():
            pin = pin_dir / name
            if name in abi.ALL_MAPS and not pin.exists():
                libbpf.check(libbpf.lib().bpf_obj_pin(fd, str(pin).encode()), f"pin the map {name} to adopt")
                log.info("reusing map %s of the programs already attached", name)
    elif adopt:
        raise ValueError("the BCC loader adopts maps through their pins: give it a pin path")
    for attempt in range(2):
        module = Module(BPF_DIR / "bcc" / "maps.c", flags, "the maps (bpf/include/pyproxy/bcc.h)")
        wrong = [name for name, (fd, want) in module.tables().items() if not _compatible(fd, want)]
        if not wrong:
            return module
        module.close()
        if pin_dir is None or attempt:
            raise loader.BpfUnavailable(f"BCC made maps of another shape than it declared: {', '.join(wrong)}")
        for name in wrong:
            log.warning("pinned map %s has another shape or size: replacing it (its entries are lost)",
                        pin_dir / name)
            (pin_dir / name).unlink(missing_ok=True)
    raise AssertionError("unreachable")


def load(
    pin_dir: Path | None,
    max_entries: dict[str, int] | None = None,
    adopt: dict[str, int] | None = None,
    ct_timeouts: abi.CtTimeoutTicks | None = None,
    snat_ports: tuple[int, int] = abi.DEFAULT_SNAT_PORTS,
    cluster_cidr: str | None = None,
    endpoint_counters: bool = False,
    kernel_flags: int | None = None,
    cluster_cidr6: str | None = None,
    socket_lb_hostns_only: bool = False,
    host_netns: int | None = None,
) -> loader.LoadedObject:
    """What loader.load does, with BCC compiling bpf/ here. Maps come from their pins under `pin_dir`, from
    `adopt` (pinned there first), or new (and pinned); pin_dir None: new, unpinned maps."""
    problem = missing()
    if problem:
        raise BccUnavailable(problem)
    config = loader.constants(ct_timeouts, snat_ports, cluster_cidr, endpoint_counters,
                              loader.kernel_features(kernel_flags), cluster_cidr6, socket_lb_hostns_only,
                              host_netns)
    max_entries = loader.capacities(max_entries)
    obj = BccObject()
    loaded = loader.LoadedObject(obj, release=BccObject.close, kernel_flags=config.kernel)
    try:
        maps = _maps(pin_dir, max_entries, adopt)
        obj.modules.append(maps)
        tables = maps.tables()
        loaded.maps = {name: fd for name, (fd, _) in tables.items() if name not in (abi.TABLE_NAME, abi.TABLE6_NAME)}
        if pin_dir is not None:
            loader.carry_over(pin_dir, loaded.maps)
            loader.unpin_other_layouts(pin_dir, set(loaded.maps), keep=loader.CARRIED_OVER)
        flags = [*_cflags(), f"-DPYPROXY_BCC_CONFIG={_config_initializer(config)}"]
        flags += [f"-D{name}=PYPROXY_BCC_MAP({fd})" for name, fd in loaded.maps.items()]
        progs = Module(BPF_DIR / "pyproxy.bpf.c", flags, str(BPF_DIR / "pyproxy.bpf.c"))
        obj.modules.append(progs)
        for name, (prog_type, attach_type) in PROGRAMS.items():
            fd = progs.load(name, prog_type, attach_type)
            obj.prog_fds.append(fd)
            loaded.progs[name] = fd
        loader.fill_jumps(loaded)
        return loaded
    except BaseException:
        loaded.close()
        raise
