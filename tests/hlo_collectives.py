"""Which collectives of a compiled XLA program may be in flight at once: pairs that no data dependency orders.

XLA:CPU starts a program's collectives in program order but lets independent ones overlap and finish in
any order, and its gloo collectives (between processes) use one tag for all of them: two collectives over
the same devices in flight at once match each other's messages, and the processes hang (seen in CI, in a
two-host replica). So every multi-host program must order its collectives by data dependency."""

from __future__ import annotations

import re

COLLECTIVE = re.compile(r" (all-to-all|ragged-all-to-all|collective-permute|all-gather|all-reduce|reduce-scatter)(-start)?\(")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%([\w.\-]+) = (.*)$")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls|branch_computations|true_computation|false_computation)=\{?([%\w.\-, ]+)\}?")


def _computations(hlo: str) -> dict[str, list[tuple[str, str, list[str], list[str]]]]:
    """name -> its instructions (name, text, operands, computations it calls), in order."""
    comps: dict[str, list] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = comps.setdefault(header.group(2), [])
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            name, text = m.group(2), m.group(3)
            called = [c.strip().lstrip("%") for group in _CALLED.findall(text) for c in group.split(",") if c.strip()]
            current.append((name, text, re.findall(r"%([\w.\-]+)", text), called))
    return comps


def unordered_collectives(hlo: str) -> list[tuple[str, str, str]]:
    """(computation, collective, collective) for every pair in one computation (a call or loop holding
    collectives counts as one) with no data dependency between them."""
    comps = _computations(hlo)
    holds: dict[str, bool] = {}

    def has_collective(comp: str) -> bool:
        if comp not in holds:
            holds[comp] = False  # cycles: none in HLO, but stay finite
            holds[comp] = any(
                COLLECTIVE.search(text) or any(has_collective(c) for c in called if c in comps) for _, text, _, called in comps[comp]
            )
        return holds[comp]

    pairs = []
    for comp, instructions in comps.items():
        names = {name for name, *_ in instructions}
        before: dict[str, set[str]] = {}
        collectives = []
        for name, text, operands, called in instructions:
            deps = set()
            for op in operands:
                if op in names and op != name:
                    deps |= {op} | before.get(op, set())
            before[name] = deps
            if (COLLECTIVE.search(text) or any(has_collective(c) for c in called if c in comps)) and not name.endswith("done"):
                collectives.append(name)
        for i, a in enumerate(collectives):
            pairs += [(comp, a, b) for b in collectives[i + 1 :] if a not in before[b] and b not in before[a]]
    return pairs


def count_collectives(hlo: str) -> int:
    return len(COLLECTIVE.findall(hlo))
