"""The nftables mode's `nft -f` scripts (pyproxy/dataplane/nftables/render.py: a first, full sync onto no table, then
partial ones, each from the table the ones before left) parsed and walked for a new flow entering the node from a
pod or a routed client.

Models: the commands the scripts hold (table, chains with their rules, maps with their elements, affinity sets and
sets with elements such as `nodeport-ips`, flushes and deletes, refused as nft refuses them: an element added again
with another verdict, a chain deleted while a rule or element still leads to it); the base chains of the prerouting
hook in priority order (filter-prerouting's `ct state new` checks of `firewall-ips` and the `no-endpoint-*` maps,
nat-prerouting's `service-ips` and `service-nodeports` lookups), then of the forward hook; verdict-map lookups by
`ip daddr . meta l4proto . th dport` and by `meta l4proto . th dport`, jump, goto, return, accept, drop; matches on
addresses (one, a CIDR, an anonymous set `{ a, b }`, a named set), ports, protocol, `ct state`, the mark and
`fib saddr type local` (a source that is one of the node's addresses, common.NODE_ADDRESSES); `numgen random mod N
0` both ways; `update @set { ip saddr }` records the source in the flow's memory, where a later flow's
`ip saddr @set` finds it (sets with `flags dynamic,timeout`); `dnat to`, `reject` (refused) and `masquerade` end the
walk. A flow neither DNATed nor dropped is the node's own stack's or routed away (common.untranslated). Any other
command or statement raises Unmodelled.
Does not model: the kernel (nft's parser, set timeouts), conntrack beyond a first packet, real randomness, the
output and postrouting hooks (the node's own traffic; masquerade changes who answers, not whether).
Each family's table (`ip pyproxy`, `ip6 pyproxy`) is a Ruleset of its own; a flow walks its family's, whose rules
must match addresses with that family's keyword (`ip saddr`, `ip6 saddr`).
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from pyproxy.dataplane.netfilter import MasqueradeSettings
from pyproxy.dataplane.nftables.backend import of_family
from pyproxy.dataplane.nftables.render import render
from pyproxy.dataplane.nftables.table import TableState
from tracers.common import NODE_ADDRESSES, Memory, Packet, Sync, Unmodelled, Verdict, untranslated
from tracers.netfilter import Flow

HOOKS = ("prerouting", "forward")
"""The hooks a forwarded flow passes, in order."""

Step = Iterator[tuple[str, Flow]]
"""Every way a statement may go: "next" (the rule goes on), "no" (it stops: the next rule), or a verdict:
"jump CHAIN", "goto CHAIN", "return", "accept", "drop", "reject", "dnat"."""
Statement = Callable[[Flow], Step]


def scripts(syncs: Sequence[Sync], masquerade: MasqueradeSettings | None = None) -> list[str]:
    """The `nft -f` scripts of `syncs` in turn, as the nftables backend's apply() renders them from the table
    the scripts before left (deletes deferred by one sync are due at the next, as a second later)."""
    states = {family: (TableState(), frozenset[str]()) for family in (4, 6)}
    out = []
    for desired, changed in syncs:
        full = changed is None
        services = dict(desired.services) if changed is None else {k: desired.services.get(k, ()) for k in changed}
        script = ""
        for family, (state, deferred) in states.items():
            plan = render(state, of_family(services, family), masquerade or MasqueradeSettings(), full=full,
                          pending=dict.fromkeys(deferred, True), lazy_deletes=not full, family=family,
                          nodeport_ips=[ip for ip in desired.node.nodeport_addresses if (":" in ip) == (family == 6)])
            states[family] = (plan.state, plan.deferred)
            script += plan.script
        out.append(script)
    return out


def split(text: str, sep: str) -> list[str]:
    """`text` cut at `sep` outside braces and quotes, each part stripped, empty ones left out."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "{}":
            depth += 1 if ch == "{" else -1
        elif not quoted and depth == 0 and ch == sep:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _elem_key(key: str, elem: str) -> tuple[str, str, int, list[str]]:
    """A verdict-map element's key, `ip . proto . port` or a node-port map's `proto . port` ("" for the address),
    and what follows it (a comment)."""
    words = shlex.split(key)
    if len(words) >= 5 and words[1] == words[3] == ".":
        return words[0], words[2], int(words[4]), words[5:]
    if len(words) >= 3 and words[1] == "." and words[0] in ("tcp", "udp", "sctp"):
        return "", words[0], int(words[2]), words[3:]
    raise Unmodelled(f"map element: {elem}")


def _match(test: Callable[[Flow], bool]) -> Statement:
    def statement(flow: Flow) -> Step:
        yield ("next" if test(flow) else "no"), flow
    return statement


class Ruleset:
    def __init__(self, text: str, family: str = "ip") -> None:
        """The commands of `text` for table `family pyproxy` ("ip" or "ip6"); the other family's are skipped."""
        self.family = family
        self.chains: dict[str, list[list[Statement]]] = {}
        self.texts: dict[str, list[str]] = {}
        """Each chain's rules as written, to find who uses a chain."""
        self.hooks: dict[str, tuple[str, int]] = {}
        """Base chain -> (hook, priority)."""
        self.maps: dict[str, dict[tuple[str, str, int], str]] = {}
        self.sets: set[str] = set()
        self.dynamic: set[str] = set()
        """Sets a rule updates (affinity): their members are in a flow's memory."""
        self.members: dict[str, set[str]] = {}
        """The other sets' elements."""
        for line in text.splitlines():
            self._command(line)

    @property
    def _addr_type(self) -> str:
        return "ipv6_addr" if self.family == "ip6" else "ipv4_addr"

    def _command(self, line: str) -> None:
        head, _, body = line.partition("{")
        words = head.split()
        if words[0] not in ("add", "flush", "delete") or words[2:4] not in (["ip", "pyproxy"], ["ip6", "pyproxy"]):
            raise Unmodelled(f"nft command: {line}")
        if words[2] != self.family:
            return  # the other family's table
        kind, name = words[1], words[4] if len(words) > 4 else ""
        parts = split(body.rpartition("}")[0], ";")
        if kind == "table" and words[0] == "add":
            return
        if words[0] == "delete":
            self._delete(kind, name, body.rpartition("}")[0], line)
        elif (words[0], kind) == ("flush", "chain"):
            self.chains[name].clear()
            self.texts[name].clear()
        elif (words[0], kind) == ("add", "chain"):  # created if new; its rules are added to those it has
            rules, texts = self.chains.setdefault(name, []), self.texts.setdefault(name, [])
            for part in parts:
                if m := re.fullmatch(r"type (filter|nat) hook (\w+) priority (-?\d+)", part):
                    self.hooks[name] = (m[2], int(m[3]))
                elif part != "policy accept":
                    rules.append(self._rule(part))
                    texts.append(part)
        elif kind == "map":
            elements = self.maps.setdefault(name, {})
            for part in parts:
                if part.startswith("elements = {"):
                    for elem in split(part.removeprefix("elements = {").removesuffix("}"), ","):
                        key, _, verdict = elem.rpartition(" : ")
                        ip, proto, port, comment = _elem_key(key, elem)
                        if comment[:1] not in ([], ["comment"]):
                            raise Unmodelled(f"map element: {elem}")
                        if elements.get((ip, proto, port), verdict) != verdict:
                            raise AssertionError(f"nft refuses to add a new value of an element: {line}")
                        elements[(ip, proto, port)] = verdict
                elif not part.startswith(("type ", "comment ")):
                    raise Unmodelled(f"map part: {part}")
        elif (words[0], kind) == ("add", "set"):
            self.sets.add(name)
            for part in parts:
                if part == "flags dynamic,timeout":
                    self.dynamic.add(name)
                elif part.startswith("elements = {"):
                    self.members.setdefault(name, set()).update(
                        split(part.removeprefix("elements = {").removesuffix("}"), ","))
                elif not part.startswith((f"type {self._addr_type}", "timeout ", "comment ")):
                    raise Unmodelled(f"set part: {part}")
        elif (words[0], kind) == ("flush", "set"):
            if name not in self.sets:
                raise AssertionError(f"nft refuses to flush set {name}, which is not there")
            self.members[name] = set()
        else:
            raise Unmodelled(f"nft command: {line}")

    def _delete(self, kind: str, name: str, body: str, line: str) -> None:
        """A delete, refused as nft refuses it: an object that is not there, or a chain still used."""
        if kind == "element":
            for elem in split(body, ","):
                ip, proto, port, _ = _elem_key(elem, elem)
                del self.maps[name][(ip, proto, port)]
        elif kind == "chain":
            use = re.compile(rf"(jump|goto) {re.escape(name)}(;|$)")
            users = [c for c, texts in self.texts.items() for t in texts if use.search(t)]
            users += [m for m, elements in self.maps.items() if f"goto {name}" in elements.values()]
            if users:
                raise AssertionError(f"nft refuses to delete chain {name}: {users} use it")
            del self.chains[name], self.texts[name]
            self.hooks.pop(name, None)
        elif kind == "set":
            self.sets.remove(name)
        elif kind == "map":
            del self.maps[name]
        else:
            raise Unmodelled(f"nft command: {line}")

    def _rule(self, text: str) -> list[Statement]:
        """One rule's statements, in order."""
        tokens = shlex.split(text.replace(f"{{ {self.family} saddr }}", "{ip-saddr}"))
        out: list[Statement] = []
        while tokens:
            out.append(self._statement(tokens, text))
        return out

    def _statement(self, t: list[str], rule: str) -> Statement:
        """The statement `t` starts with, taken off `t`."""
        word = t.pop(0)
        if word in ("jump", "goto"):
            target = t.pop(0)
            return lambda f: iter([(f"{word} {target}", f)])
        if word in ("return", "accept", "drop"):
            return lambda f: iter([(word, f)])
        if word == "ct" and t[:2] == ["state", "new"]:
            del t[:2]
            return _match(lambda f: True)  # every traced flow is new
        if word in ("ip", "ip6") and word != self.family:
            raise Unmodelled(f"an {word} match in table {self.family} pyproxy: {rule}")
        if word == self.family and t[:1] == ["daddr"] and t[1:7] == [".", "meta", "l4proto", ".", "th", "dport"]:
            del t[:7]
            if t.pop(0) != "vmap":
                raise Unmodelled(f"a lookup that is no vmap: {rule}")
            elements = self.maps.setdefault(t.pop(0).removeprefix("@"), {})  # filled by later commands too

            def lookup(f: Flow) -> Step:
                verdict = elements.get((f.pkt.dst, f.pkt.proto, f.pkt.port))
                yield (verdict or "no"), f
            return lookup
        if word == self.family and t[:1] in (["saddr"], ["daddr"]):
            field = t.pop(0)
            negate = t[0] == "!="
            if negate:
                t.pop(0)
            value = t.pop(0)
            addr: Callable[[Flow], str] = (lambda f: f.pkt.src) if field == "saddr" else (lambda f: f.pkt.dst)
            if value.startswith("@"):
                name = value[1:]
                if name not in self.sets:
                    raise Unmodelled(f"a set the script does not make: {rule}")
                if name in self.dynamic:
                    return _match(lambda f: (("set", name, addr(f)) in f.memory) != negate)
                return _match(lambda f: (addr(f) in self.members.get(name, set())) != negate)
            if value == "{":  # an anonymous set: `{ a, b/16 }`
                nets = []
                while (value := t.pop(0)) != "}":
                    nets.append(ipaddress.ip_network(value.rstrip(",")))
                return _match(lambda f: any(ipaddress.ip_address(addr(f)) in n for n in nets) != negate)
            net = ipaddress.ip_network(value)
            return _match(lambda f: (ipaddress.ip_address(addr(f)) in net) != negate)
        if word == "fib" and t[:3] == ["saddr", "type", "local"]:
            del t[:3]
            return _match(lambda f: f.pkt.src in NODE_ADDRESSES)
        if word == "meta" and t[:5] == ["l4proto", ".", "th", "dport", "vmap"]:
            del t[:5]
            by_port = self.maps.setdefault(t.pop(0).removeprefix("@"), {})

            def port_lookup(f: Flow) -> Step:
                yield (by_port.get(("", f.pkt.proto, f.pkt.port)) or "no"), f
            return port_lookup
        if word in ("tcp", "udp") and t[:1] == ["dport"]:
            port = int(t[1])
            del t[:2]
            return _match(lambda f: f.pkt.proto == word and f.pkt.port == port)
        if word == "meta" and t[:1] == ["l4proto"] and t[1] in ("tcp", "udp"):
            proto = t[1]
            del t[:2]
            return _match(lambda f: f.pkt.proto == proto)
        if word == "numgen" and t[:2] == ["random", "mod"]:
            n, equals = int(t[2]), t[3]
            del t[:4]
            if equals != "0":
                raise Unmodelled(f"numgen compared with {equals}: {rule}")
            return lambda f: iter([("next", f)] if n == 1 else [("next", f), ("no", f)])
        if word == "update" and t[:1] and t[0].startswith("@") and t[1:2] == ["{ip-saddr}"]:
            name = t.pop(0)[1:]
            t.pop(0)
            if name not in self.sets:
                raise Unmodelled(f"update of a set the script does not make: {rule}")
            return lambda f: iter([("next", replace(f, memory=f.memory | {("set", name, f.pkt.src)}))])
        if word == "dnat" and t[:1] == ["to"]:
            to_ip, to_port = t[1].rsplit(":", 1)
            to_ip = to_ip.strip("[]")  # ip6: `dnat to [addr]:port`
            del t[:2]
            return lambda f: iter([("dnat", replace(f, pkt=replace(f.pkt, dst=to_ip, port=int(to_port))))])
        if word == "reject":
            if t[:3] == ["with", "tcp", "reset"]:
                del t[:3]
            return lambda f: iter([("reject", f)])
        if word == "masquerade":
            if t[:1] == ["fully-random"]:
                t.pop(0)
            return lambda f: iter([("accept", f)])
        if word == "mark":
            if t[:3] == ["set", "mark", "or"] or t[:3] == ["set", "mark", "xor"]:
                op, bits = t[2], int(t[3], 16)
                del t[:4]
                return lambda f: iter([("next", replace(f, mark=(f.mark | bits) if op == "or" else (f.mark ^ bits)))])
            if t[:1] == ["and"] and t[2:4] == ["==", "0"]:
                mask = int(t[1], 16)
                del t[:4]
                return _match(lambda f: f.mark & mask == 0)
        raise Unmodelled(f"statement {word} {' '.join(t[:3])} in: {rule}")

    def walk(self, chain: str, flow: Flow) -> Iterator[tuple[str, Flow]]:
        """Every way `flow` may leave `chain`: "return" (its end, or a return) or a final verdict."""
        if chain not in self.chains:
            raise Unmodelled(f"a jump to chain {chain}, which the script does not make")
        pending = [(0, flow)]
        while pending:
            i, f = pending.pop()
            if i == len(self.chains[chain]):
                yield "return", f
                continue
            for verdict, g in self._rule_ways(self.chains[chain][i], f):
                if verdict in ("no", "next"):
                    pending.append((i + 1, g))
                elif verdict.startswith("jump "):
                    for v, h in self.walk(verdict[5:], g):
                        if v == "return":
                            pending.append((i + 1, h))
                        else:
                            yield v, h
                elif verdict.startswith("goto "):
                    yield from self.walk(verdict[5:], g)
                else:
                    yield verdict, g

    @staticmethod
    def _rule_ways(rule: list[Statement], flow: Flow) -> Iterator[tuple[str, Flow]]:
        ways: list[tuple[int, Flow]] = [(0, flow)]
        while ways:
            i, f = ways.pop()
            if i == len(rule):
                yield "next", f
                continue
            for outcome, g in rule[i](f):
                if outcome == "next":
                    ways.append((i + 1, g))
                else:
                    yield outcome, g

    def hook(self, hook: str, ways: list[tuple[str, Flow]]) -> list[tuple[str, Flow]]:
        """Every way flows on their `ways` may leave the base chains of `hook`, in priority order: "pass" (a
        chain's end, return, accept, or a NAT statement, which ends only its own chain), "drop" or "reject"."""
        for _, chain in sorted((prio, name) for name, (h, prio) in self.hooks.items() if h == hook):
            ways = [(("pass" if v in ("return", "accept", "dnat") else v), g)
                    for v, f in ways for v, g in (self.walk(chain, f) if v == "pass" else [(v, f)])]
        return ways


class NftablesTracer:
    def __init__(self, scripts: Sequence[str]) -> None:
        text = "".join(scripts)  # one `nft -f` after the other
        self.ruleset, self.ruleset6 = Ruleset(text), Ruleset(text, "ip6")

    def flows(self, pkt: Packet, memory: Memory) -> Iterator[Verdict]:
        ruleset = self.ruleset6 if ":" in pkt.dst else self.ruleset
        ways = [("pass", Flow(pkt, memory=memory))]
        for hook in HOOKS:
            ways = ruleset.hook(hook, ways)
        for verdict, f in ways:
            if verdict == "reject":
                yield Verdict("refused")
            elif verdict == "drop":
                yield Verdict("no-answer")
            elif f.pkt == pkt:
                yield untranslated(pkt)
            else:
                yield Verdict("dnat", f"{f.pkt.dst}:{f.pkt.port}", f.memory)


def tracer(syncs: Sequence[Sync]) -> NftablesTracer:
    return NftablesTracer(scripts(syncs))
