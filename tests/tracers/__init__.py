"""Tracers: each follows a new flow through one proxy mode's rendered plan — the pure `render()` output, never
the kernel — and answers the flow table's outcome (tests/flowcases.py), so `make unit` runs the same table the
privileged end-to-end test runs with real packets, in seconds and without root.

`common` gets the syncs pyproxy makes for the table's manifests (the proxier's applies: a first, full one, and
a partial one from another cluster, `BEFORE`) and turns a tracer's verdicts into an Outcome; `bpf`, `ipvs`,
`iptables` and `nftables` hold one tracer each. They model only the rule forms their renderer emits: anything else
fails the trace (`Unmodelled`), so a renderer change cannot pass unnoticed.

Tests import it as `tracers` (and it imports `flowcases`): tests/conftest.py, the rootdir conftest of a tests/
folder without __init__.py, puts tests/ on sys.path, as it does for flowcases and apiobjects.
"""
