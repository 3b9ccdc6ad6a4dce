"""The import graph of jdp/: layered, one way, no cycles (run by `make lint`).

Each module belongs to a layer; it may import modules of its own layer or
below, never above, and the graph has no cycle. A new module must be given a
layer here, so its place in the architecture is a decision, not an accident.
"""

import ast
import pathlib
import sys

# Bottom to top. Strategies sit above the core they use; the core (replication,
# checkpoints, backends, the loop) knows no strategy but the default one the
# step types name.
LAYERS = [
    [
        "jdp._version",
        "jdp._args",
        "jdp._jax_private",
        "jdp._extras",
        "jdp._ledger",
        "jdp._pace",
        "jdp._host_callbacks",
        "jdp._schedule",
    ],
    ["jdp._tree", "jdp._devices", "jdp._watchdog", "jdp._bitflip"],
    ["jdp.distributed", "jdp._batching", "jdp._collectives", "jdp._conv_layout"],
    ["jdp._layout", "jdp._peer_rows", "jdp._weighting", "jdp._loss_scale", "jdp._precision"],
    ["jdp._replication", "jdp._state"],
    ["jdp._forward", "jdp._update"],
    ["jdp.metrics._base", "jdp.metrics._builtin", "jdp.metrics._fingerprint", "jdp.metrics"],
    ["jdp._audit", "jdp._phases"],
    ["jdp._stamps"],
    [
        "jdp.strategies._base",
        "jdp.strategies._elementwise",
        "jdp.strategies._slices",
        "jdp.strategies._cast",
        "jdp.strategies._data_parallel",
        "jdp.strategies._recompute",
        "jdp.strategies._exact",
        "jdp.strategies._zero1",
        "jdp.strategies._fsdp",
        "jdp.strategies",
    ],
    ["jdp._steps", "jdp._step"],
    ["jdp.backends._checks", "jdp.backends._runner"],
    ["jdp.backends._shard_map", "jdp.backends._pmap"],
    ["jdp.backends"],
    ["jdp._faults", "jdp._replay"],
    [
        "jdp.testing",
        "jdp._evaluation",
        "jdp._checkpoint",
        "jdp._standby",
        "jdp._standby_restore",
        "jdp._data",
        "jdp._tensorboard",
    ],
    ["jdp._recycle", "jdp._timed"],
    ["jdp._loop", "jdp.nnx"],
    ["jdp", "jdp.launch", "jdp.demo", "jdp.verify"],
]


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The jdp modules ``path`` imports (``from jdp import x`` counts as ``jdp.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found.update(subs or ({node.module} & known))
    return found


def graph(root: pathlib.Path) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in sorted((root / "jdp").rglob("*.py"))}
    known = set(files)
    return {m: imports(p, known) - {m} for m, p in files.items()}


def problems(edges: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    rank = {m: i for i, layer in enumerate(layers) for m in layer}
    out = [f"{m} has no layer in tests/import_graph.py" for m in sorted(set(edges) - set(rank))]
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            if m in rank and t in rank and rank[t] > rank[m]:
                out.append(f"{m} (layer {rank[m]}) imports {t} (layer {rank[t]}): an upward import")
    out.extend(f"import cycle: {' -> '.join(c)}" for c in _cycles(edges))
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for t in sorted(edges.get(m, ())):
            if state.get(t) == "open":
                found.append(path[path.index(t) :] + [t])
            elif t not in state:
                visit(t, [*path, t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


if __name__ == "__main__":
    root = pathlib.Path(__file__).resolve().parent.parent
    edges = graph(root)
    issues = problems(edges, LAYERS)
    for line in issues:
        print(line)
    print(
        f"import graph: {len(edges)} modules, {sum(map(len, edges.values()))} edges, "
        f"{len(issues)} problems"
    )
    sys.exit(1 if issues else 0)
