"""The bpf dataplane's error for "this node cannot run it", in a module of its own so that the modules raising it
(loader.py, clock.py) do not import each other for it."""

from __future__ import annotations


class BpfUnavailable(RuntimeError):
    """The kernel, the object file or our privileges cannot run the BPF dataplane; says which."""
