"""A UDP client on one fixed source port while its Service's endpoint is replaced (issue 11; upstream kubernetes
issues 19029, 48370, 125467): shared by the host's end-to-end test (tests/e2e/test_udp_endpoint_switch.py, every
host mode) and the IPVS guest's (tests/guest_ipvs).

`measure(lab, targets, change)` runs CLIENT in the lab's client namespace, calls `change()` (which rewrites the
manifest) once the fixed-port flows are up, and returns, per target, (applied, switched): seconds from the change
to the first answer from b2 to a brand-new flow (the rules are in) and to the fixed-port flow, after checking that
the fixed-port flow reached only b1 before the change, reached b2 after it, and never went back.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping

from labkit import Lab

Target = tuple[str, int, int]
"""(address, port, the client's fixed source port); an IPv6 address makes an IPv6 flow."""

# Every 50 ms, per target: one datagram from the FIXED source port (a connected socket, as a DNS stub resolver's),
# and one from a fresh socket (a new flow: shows when the rules changed). Every answer is printed as it comes,
# with the wall-clock time; it stops at EOF on stdin. A fixed socket that fails (bpf mode destroys a node process's
# socket pointed at an endpoint that left: ECONNABORTED) is opened again on the same port, as a resolver does.
CLIENT = """
import json, select, socket, sys, time
targets = json.loads(sys.argv[1])
def open_fixed(ip, port, sport):
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("::" if ":" in ip else "0.0.0.0", sport))
    s.connect((ip, port))
    return s
def reopen(s):
    name = fixed.pop(s)
    s.close()
    fixed[open_fixed(*targets[name])] = name
fixed = {open_fixed(ip, port, sport): name for name, (ip, port, sport) in targets.items()}
fresh = {}
print(json.dumps({"ready": True}), flush=True)
while True:
    for s in list(fixed):
        try:
            s.send(b"probe\\n")
        except OSError:
            reopen(s)
    for name, (ip, port, _) in targets.items():
        f = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM)
        f.connect((ip, port))
        f.send(b"probe\\n")
        fresh[f] = (name, time.monotonic())
    end = time.monotonic() + 0.05
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([sys.stdin, *fixed, *fresh], [], [], left)
        if sys.stdin in ready:
            sys.exit(0)
        for s in ready:
            if s not in fixed and s not in fresh:
                continue  # a fixed socket reopened in this loop
            try:
                reply = s.recv(1024).decode().strip()
            except OSError:
                reply = None
            if s in fixed:
                kind, name = "fixed", fixed[s]
                if reply is None:
                    reopen(s)
            else:
                kind, name = "fresh", fresh.pop(s)[0]
                s.close()
            if reply:
                print(json.dumps({"t": time.time(), "kind": kind, "target": name, "reply": reply}), flush=True)
    for f, (name, sent) in list(fresh.items()):
        if time.monotonic() - sent > 1.0:
            del fresh[f]
            f.close()
"""


def measure(lab: Lab, targets: Mapping[str, Target], change: Callable[[], None], *, settle: float = 1.5,
            watch: float = 4.0, old: str = "b1", new: str = "b2",
            ns: str | None = None) -> dict[str, tuple[float, float]]:
    """`ns`: the client's namespace (a pod's: inside the lab's cgroup where the lab puts its pods there), else the
    lab's outside client."""
    client = lab.popen(ns or lab.client, sys.executable, "-c", CLIENT, json.dumps(targets), client=True, stdin=-1,
                       stdout=-1, text=True)
    assert client.stdin is not None and client.stdout is not None
    try:
        assert json.loads(client.stdout.readline()) == {"ready": True}
        time.sleep(settle)  # the fixed-port flows are established to `old` (checked below)
        changed = time.time()
        change()
        time.sleep(watch)
    finally:
        out, _ = client.communicate(timeout=10)  # closes stdin: the client stops
    answers = [json.loads(line) for line in out.splitlines() if line.strip()]

    def backend(a: dict[str, object]) -> str:
        return str(a["reply"]).split(":", 1)[0]

    timings = {}
    for target in targets:
        mine = [a for a in answers if a["target"] == target]
        fixed_before = {backend(a) for a in mine if a["kind"] == "fixed" and a["t"] < changed}
        assert fixed_before == {old}, f"{target}: before the change the fixed-port flow reached {fixed_before}"
        applied = next((a["t"] - changed for a in mine if a["kind"] == "fresh" and a["t"] > changed
                        and backend(a) == new), None)
        switched = next((a["t"] - changed for a in mine if a["kind"] == "fixed" and a["t"] > changed
                         and backend(a) == new), None)
        assert applied is not None, f"{target}: no new flow reached {new} within {watch:g}s of the change"
        assert switched is not None, f"{target}: the fixed-port flow never reached {new} (stale flow kept)"
        late = [a["t"] - changed for a in mine if a["kind"] == "fixed" and a["t"] > changed + switched
                and backend(a) == old]
        assert not late, f"{target}: the fixed-port flow went back to {old} after switching: {late}"
        timings[target] = (applied, switched)
    return timings


def describe(timings: Mapping[str, tuple[float, float]]) -> str:
    return "; ".join(f"{t}: applied {a:.2f}s, fixed port switched {s:.2f}s after the change"
                     for t, (a, s) in timings.items())
