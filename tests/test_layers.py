"""The package's imports run one way, from file formats up to the frontends, with no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "deltaserve"

# lowest first: a module may import its own layer or a lower one, never a higher one
LAYERS = [
    ("base", ["deltaserve.errors", "deltaserve.cachedir", "deltaserve.cbuild", "deltaserve.version"]),
    ("text", ["deltaserve.text"]),
    ("formats", ["deltaserve.formats"]),
    ("kernels", ["deltaserve.kernels"]),
    ("engine", ["deltaserve.engine"]),
    ("runtime", ["deltaserve.runtime"]),
    ("session", ["deltaserve.session", "deltaserve.sampling", "deltaserve.store", "deltaserve.grammar"]),
    ("api", ["deltaserve.api", "deltaserve.demo"]),
    ("frontends", ["deltaserve.frontends", "deltaserve.__main__", "deltaserve"]),
]


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    if rank is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return rank


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every deltaserve module `path` imports, at any depth of the file (function-level imports count)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "deltaserve"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "deltaserve":
                continue
            for a in node.names:  # `from deltaserve.kernels import native` imports a module
                sub = f"{target}.{a.name}"
                found.add(sub if _is_module(sub) else target)
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for mod, targets in sorted(graph().items()):
        for t in sorted(targets):
            if layer_of(t) > layer_of(mod):
                upward.append(f"{mod} ({LAYERS[layer_of(mod)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})")
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_the_modules_import_one_another_without_a_cycle():
    g = graph()
    cycles, index, low, stack, on, counter = [], {}, {}, [], set(), [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    assert layer_of("deltaserve.formats.gguf") < layer_of("deltaserve.engine.forward")
    assert layer_of("deltaserve.frontends.server.app") == len(LAYERS) - 1
    fake = PACKAGE / "formats" / "_probe_upward.py"
    if not fake.parent.exists():
        return  # before the layout exists there is nothing to probe
    fake.write_text("from deltaserve.engine import forward\n")
    try:
        assert imports(fake) == {"deltaserve.engine.forward"}
        assert layer_of(module_name(fake)) < layer_of("deltaserve.engine.forward")
    finally:
        fake.unlink()
