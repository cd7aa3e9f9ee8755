"""The links of an API-format prompt: what feeds what, cycles, and the order to run in."""
from __future__ import annotations

from typing import Any


def is_link(value: Any) -> bool:
    return isinstance(value, list)


def links(node: dict) -> list[tuple[str, Any]]:
    return [(name, v) for name, v in node.get("inputs", {}).items() if is_link(v)]


def depends_on(prompt: dict, out_id: str, node_id: str) -> bool:
    """Whether node_id is out_id or upstream of it (following well-formed links only)."""
    seen, stack = set(), [out_id]
    while stack:
        nid = stack.pop()
        if nid == node_id:
            return True
        if nid in seen or nid not in prompt:
            continue
        seen.add(nid)
        for _, v in links(prompt[nid]):
            if len(v) == 2 and str(v[0]) in prompt:
                stack.append(str(v[0]))
    return False


def nodes_in_cycles(prompt: dict) -> list[str]:
    """Nodes that can reach themselves through links (cycle members, not their dependants)."""
    deps = {nid: {str(v[0]) for _, v in links(n) if len(v) == 2 and str(v[0]) in prompt}
            for nid, n in prompt.items()}
    # Kahn: whatever cannot be ordered is in a cycle or downstream of one.
    indeg = {nid: len(d) for nid, d in deps.items()}
    users: dict[str, list[str]] = {nid: [] for nid in prompt}
    for nid, d in deps.items():
        for src in d:
            users[src].append(nid)
    ready = [nid for nid, k in indeg.items() if k == 0]
    while ready:
        nid = ready.pop()
        for u in users[nid]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    stuck = [nid for nid, k in indeg.items() if k > 0]
    in_cycle = []
    for start in stuck:
        seen, stack = set(), list(deps[start])
        while stack:
            nid = stack.pop()
            if nid == start:
                in_cycle.append(start)
                break
            if nid not in seen:
                seen.add(nid)
                stack.extend(deps[nid])
    return in_cycle


def execution_order(prompt: dict, outputs: list[str]) -> list[str]:
    """Topological order of the nodes the outputs need (dependencies first, stable)."""
    order: list[str] = []
    done: set[str] = set()
    for out_id in outputs:
        stack: list[tuple[str, bool]] = [(out_id, False)]
        while stack:
            nid, expanded = stack.pop()
            if nid in done:
                continue
            if expanded:
                done.add(nid)
                order.append(nid)
                continue
            stack.append((nid, True))
            # Reversed so the first-declared input runs first.
            for _, v in reversed(links(prompt[nid])):
                if str(v[0]) not in done:
                    stack.append((str(v[0]), False))
    return order
