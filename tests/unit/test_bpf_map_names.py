"""Map names as the kernel keeps them (15 characters) mapped back to abi's: what a restart adopts and
`pyproxy inspect` reads from the attached programs."""

from __future__ import annotations

from pyproxy.dataplane.bpf import abi, attach


def test_every_map_is_found_under_its_cut_name() -> None:
    for name in abi.ALL_MAPS:
        assert attach.abi_map_name(name[: attach.KERNEL_NAME_LEN]) == name


def test_the_epoch_map_is_one_the_kernel_cuts() -> None:
    assert len(abi.MAP_EPOCH) > attach.KERNEL_NAME_LEN  # the reason restarts never adopted it
    assert attach.abi_map_name("pyproxy_epoch_v") == abi.MAP_EPOCH


def test_cut_names_stay_distinct_and_others_are_not_ours() -> None:
    assert len({n[: attach.KERNEL_NAME_LEN] for n in abi.ALL_MAPS}) == len(abi.ALL_MAPS)
    assert attach.abi_map_name("pyproxy.rodata") is None
    assert attach.abi_map_name("cilium_lb4_serv") is None
