"""An iptables-restore text as tables of parsed rules, and a walk of a new flow through them: what the
iptables tracer and the ipvs tracer's rules share.

Only the rule forms pyproxy's netfilter modes write are parsed; any other option or target raises Unmodelled.
A walk follows every branch a rule may take (`-m statistic` both ways), so it answers every way the flow may
end. Models: addresses and ports, `-m statistic --mode random` (both branches), `-m recent` (`--set` records
the source in the flow's memory, `--rcheck` finds it there: no timeout), `-m conntrack --ctstate` (the flow is
NEW), `-m mark`, `-m set` over the ipsets given (contents as `ipset save` prints them: hash:ip,port and the
like, bitmap:port, hash:…,net by containment), `-m addrtype --src-type/--dst-type LOCAL` (the node's addresses,
as the tracer says them), the targets DNAT,
REJECT, MARK, MASQUERADE (ends the chain), ACCEPT, DROP, RETURN and jumps. Not modelled: the kernel's
conntrack beyond a first packet, interfaces, counters, the order of tables on one hook but nat before filter.
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pyproxy.dataplane import netfilter as nf
from tracers.common import Memory, Packet, Unmodelled


@dataclass(frozen=True)
class Flow:
    """A new flow's first packet as the rules see it, with what it carries and leaves behind."""

    pkt: Packet
    mark: int = 0
    memory: Memory = frozenset()


Match = Callable[[Flow], Iterator[tuple[bool, Flow]]]
"""Every way a match may go for `flow`: (matched, the flow after it)."""


def _always(test: Callable[..., bool], *bound: Any, negate: bool = False) -> Match:
    """A match that goes one way: `test(flow, *bound)`, negated with `!`."""
    def match(flow: Flow) -> Iterator[tuple[bool, Flow]]:
        yield test(flow, *bound) != negate, flow
    return match


def _random(probability: float) -> Match:
    def match(flow: Flow) -> Iterator[tuple[bool, Flow]]:
        if probability > 0:
            yield True, flow
        if probability < 1:
            yield False, flow
    return match


def _recent_set(name: str) -> Match:
    def match(flow: Flow) -> Iterator[tuple[bool, Flow]]:
        yield True, replace(flow, memory=flow.memory | {("recent", name, flow.pkt.src)})
    return match


def _in(cidr: str) -> Callable[[str], bool]:
    net = ipaddress.ip_network(cidr)
    return lambda ip: ipaddress.ip_address(ip) in net


@dataclass(frozen=True)
class Rule:
    text: str
    matches: tuple[Match, ...]
    target: str
    args: Mapping[str, str] = field(default_factory=dict)


IpSets = Mapping[str, tuple[str, frozenset[str]]]
"""Set name -> (type, e.g. "hash:ip,port"; members as `ipset save` prints them)."""


def _in_set(kind: str, flags: str, members: frozenset[str], pkt: Packet) -> bool:
    """Whether `pkt`, looked at by `flags` (e.g. "dst,dst,src"), is in a set of type `kind` with `members`."""
    parts, net = [], None
    for dim, flag in zip(kind.split(":")[1].split(","), flags.split(","), strict=True):
        if dim == "ip":
            parts.append(pkt.src if flag == "src" else pkt.dst)
        elif dim == "port" and flag == "dst":
            # A bitmap holds port numbers; a hash's members name the protocol too.
            parts.append(str(pkt.port) if kind.startswith("bitmap:") else f"{pkt.proto}:{pkt.port}")
        elif dim == "net" and flag == "src" and net is None:
            net = pkt.src
        else:
            raise Unmodelled(f"ipset dimension {dim} by {flag}")
    entry = ",".join(parts)
    if net is None:
        return entry in members
    # hash:...,net: a member is the other dimensions and a network (a /32 printed as a plain address).
    return any(m.rsplit(",", 1)[0] == entry and _in(m.rsplit(",", 1)[1])(net) for m in members)


def parse_rule(body: str, ipsets: IpSets, local: Callable[[str], bool] | None = None) -> Rule:
    tokens = shlex.split(body)
    matches: list[Match] = []
    args: dict[str, str] = {}
    target = ""
    negate = False
    it = iter(tokens)
    for tok in it:
        if tok == "!":
            negate = True
            continue
        if target:  # the target's options
            if tok in ("--to-destination", "--reject-with", "--or-mark", "--xor-mark"):
                args[tok] = next(it)
            elif tok != "--random-fully":
                raise Unmodelled(f"target option {tok} in: {body}")
        elif tok == "-j":
            target = next(it)
        elif tok == "-m":
            module = next(it)
            if module not in ("comment", "tcp", "udp", "statistic", "recent", "conntrack", "mark", "set", "addrtype"):
                raise Unmodelled(f"match -m {module} in: {body}")
        elif tok == "--comment":
            next(it)
        elif tok == "-p":
            proto = next(it)
            matches.append(_always(lambda f, p: f.pkt.proto == p, proto, negate=negate))
        elif tok in ("-d", "-s"):
            addr = _in(next(it))
            matches.append(_always(lambda f, a, d: a(f.pkt.dst if d else f.pkt.src), addr, tok == "-d", negate=negate))
        elif tok == "--dport":
            port = int(next(it))
            matches.append(_always(lambda f, n: f.pkt.port == n, port, negate=negate))
        elif tok == "--mode" and next(it) == "random" and next(it) == "--probability":
            matches.append(_random(float(next(it))))
        elif tok == "--name":
            name, action = next(it), next(it)
            if action == "--set":
                matches.append(_recent_set(name))
            elif action == "--rcheck":
                matches.append(_always(lambda f, n: ("recent", n, f.pkt.src) in f.memory, name, negate=negate))
            else:
                raise Unmodelled(f"-m recent {action} in: {body}")
        elif tok == "--seconds":
            next(it)  # the affinity timeout: flows here are never that far apart
        elif tok == "--reap":
            pass
        elif tok in ("--src-type", "--dst-type"):
            if next(it) != "LOCAL" or local is None:
                raise Unmodelled(f"addrtype {tok} in: {body}")
            matches.append(_always(lambda f, d, is_local: is_local(f.pkt.dst if d else f.pkt.src), tok == "--dst-type",
                                   local, negate=negate))
        elif tok == "--ctstate":
            states = next(it).split(",")
            matches.append(_always(lambda f, s: "NEW" in s, states, negate=negate))
        elif tok == "--mark":
            value, mask = (int(x, 16) for x in next(it).split("/"))
            matches.append(_always(lambda f, v, m: f.mark & m == v, value, mask, negate=negate))
        elif tok == "--match-set":
            name, flags = next(it), next(it)
            if name not in ipsets:
                raise Unmodelled(f"ipset {name} that the plan does not make: {body}")
            kind, members = ipsets[name]
            matches.append(_always(lambda f, k, fl, m: _in_set(k, fl, m, f.pkt), kind, flags, members, negate=negate))
        else:
            raise Unmodelled(f"option {tok} in: {body}")
        negate = False
    if not target:
        raise Unmodelled(f"a rule without a target: {body}")
    return Rule(body, tuple(matches), target, args)


class Tables:
    """An iptables-restore text (one or more `*table ... COMMIT` parts) as {table: {chain: [Rule]}}."""

    def __init__(self, text: str, ipsets: IpSets | None = None, local: Callable[[str], bool] | None = None) -> None:
        """`local`: whether an address is the node's own (`-m addrtype ... LOCAL`); None: such rules fail."""
        self.chains: dict[str, dict[str, list[Rule]]] = {}
        table: dict[str, list[Rule]] = {}
        for line in text.splitlines():
            if line.startswith("*"):
                table = self.chains.setdefault(line[1:], {})
            elif line.startswith(":"):
                table[line[1:].split()[0]] = []  # created or flushed
            elif line.startswith(("-A ", "-I ")):
                verb, chain, rest = line.split(" ", 2)
                if verb == "-I":
                    position, rest = rest.split(" ", 1)
                    if position != "1":
                        raise Unmodelled(f"insert at {position}: {line}")
                rule = parse_rule(rest, ipsets or {}, local)
                if chain not in table and chain not in nf.BUILTIN_CHAINS:
                    raise Unmodelled(f"a rule in chain {chain}, which the text does not declare: {line}")
                rules = table.setdefault(chain, [])
                rules.insert(0, rule) if verb == "-I" else rules.append(rule)
            elif line.startswith("-X "):
                del table[line[3:]]
            elif line != "COMMIT":
                raise Unmodelled(f"restore line: {line}")

    def walk(self, table: str, chain: str, flow: Flow) -> Iterator[tuple[str, Flow]]:
        """Every way `flow` may leave `chain`: ("RETURN", …) at its end or by RETURN (a built-in chain's
        policy, ACCEPT, then applies), or a verdict: ACCEPT, DROP, REJECT, DNAT (the flow's destination
        rewritten)."""
        rules = self.chains.get(table, {}).get(chain, [])
        pending = [(0, flow)]
        while pending:
            i, f = pending.pop()
            if i == len(rules):
                yield "RETURN", f
                continue
            rule = rules[i]
            for matched, g in self._test(rule, f):
                if not matched:
                    pending.append((i + 1, g))
                    continue
                for verdict, h in self._fire(table, rule, g):
                    if verdict == "CONTINUE":
                        pending.append((i + 1, h))
                    else:
                        yield verdict, h

    @staticmethod
    def _test(rule: Rule, flow: Flow) -> Iterator[tuple[bool, Flow]]:
        ways = [(True, flow)]
        for match in rule.matches:
            ways = [w for ok, f in ways if ok for w in match(f)] + [(ok, f) for ok, f in ways if not ok]
        return iter(ways)

    def _fire(self, table: str, rule: Rule, flow: Flow) -> Iterator[tuple[str, Flow]]:
        t, args = rule.target, rule.args
        if t in ("ACCEPT", "DROP", "RETURN"):
            yield t, flow
        elif t == "REJECT":
            if table != "filter":
                raise Unmodelled(f"REJECT in {table}: {rule.text}")
            yield t, flow
        elif t == "MASQUERADE":
            yield "ACCEPT", flow
        elif t == "DNAT":
            ip, port = args["--to-destination"].rsplit(":", 1)  # an IPv6 address in brackets: [addr]:port
            yield "DNAT", replace(flow, pkt=replace(flow.pkt, dst=ip.strip("[]"), port=int(port)))
        elif t == "MARK":
            if "--or-mark" in args:
                yield "CONTINUE", replace(flow, mark=flow.mark | int(args["--or-mark"], 16))
            else:
                yield "CONTINUE", replace(flow, mark=flow.mark ^ int(args["--xor-mark"], 16))
        elif t in self.chains.get(table, {}):
            for verdict, f in self.walk(table, t, flow):
                yield ("CONTINUE" if verdict == "RETURN" else verdict), f
        else:
            raise Unmodelled(f"target {t} (no such chain in {table}): {rule.text}")
