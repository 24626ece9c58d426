"""The repository's imports run one way, from file formats up to the frontends and on to the tools, with no cycle.

Every module of src/deltaserve, tools/ and scripts/ is named in exactly one layer (no catch-all: a new module
fails here until it is placed); a module may import its own layer or a lower one; the graph of the whole
repository has no cycle (the bench imports the package, never the reverse). The checker is itself checked on
modules it writes into a temporary directory: an upward import and a real cycle are found.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = {"deltaserve": ROOT / "src" / "deltaserve", "tools": ROOT / "tools", "scripts": ROOT / "scripts"}

# lowest first. "x.*" names a package and every module in it; a bare name is that one module.
LAYERS = [
    ("base", ["deltaserve.errors", "deltaserve.settings", "deltaserve.cachedir", "deltaserve.cbuild", "deltaserve.version"]),
    ("text", ["deltaserve.text.*"]),
    ("formats", ["deltaserve.formats.*"]),
    ("kernels", ["deltaserve.kernels.*"]),
    ("vision", ["deltaserve.vision.*"]),
    ("engine", ["deltaserve.engine.*"]),
    ("runtime", ["deltaserve.runtime.*"]),
    ("session", ["deltaserve.session.*"]),
    ("api", ["deltaserve.api", "deltaserve.demo", "deltaserve.hub"]),
    ("frontends", ["deltaserve.frontends.*", "deltaserve.ray", "deltaserve.__main__", "deltaserve"]),
    ("tools", ["tools.*", "scripts.*"]),
]


def matches(entry: str, module: str) -> bool:
    if entry.endswith(".*"):
        package = entry[:-2]
        return module == package or module.startswith(package + ".")
    return module == entry


def layers_of(module: str, layers=LAYERS) -> list[int]:
    return [i for i, (_, entries) in enumerate(layers) for e in entries if matches(e, module)]


def layer_of(module: str, layers=LAYERS) -> int:
    found = layers_of(module, layers)
    if len(found) != 1:
        raise AssertionError(f"{module} is named in {len(found)} layers, not one: place it in LAYERS")
    return found[0]


def module_name(path: Path, trees: dict[str, Path]) -> str:
    for top, base in trees.items():
        if path.is_relative_to(base):
            parts = [top, *path.relative_to(base).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(f"{path} is in no tree")


def _is_module(name: str, trees: dict[str, Path]) -> bool:
    top, *rest = name.split(".")
    base = trees.get(top)
    if base is None:
        return False
    rel = base.joinpath(*rest)
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


def imports(path: Path, trees: dict[str, Path]) -> set[str]:
    """Every module of the trees `path` imports, at any depth of the file (function-level imports count)."""
    name = module_name(path, trees)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in trees}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in trees:
                continue
            for a in node.names:  # `from deltaserve.kernels import native` imports a module
                sub = f"{target}.{a.name}"
                found.add(sub if _is_module(sub, trees) else target)
    return found


def graph(trees: dict[str, Path] = TREES) -> dict[str, set[str]]:
    return {module_name(p, trees): imports(p, trees) for base in trees.values() for p in sorted(base.rglob("*.py"))}


def upward(g: dict[str, set[str]], layers=LAYERS) -> list[str]:
    out = []
    for mod, targets in sorted(g.items()):
        for t in sorted(targets):
            if t in g and layer_of(t, layers) > layer_of(mod, layers):
                out.append(f"{mod} ({layers[layer_of(mod, layers)][0]}) imports {t} "
                           f"({layers[layer_of(t, layers)][0]})")
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    found, index, low, stack, on, counter = [], {}, {}, [], set(), [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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
            if len(comp) > 1 or v in g.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_every_module_of_the_repository_is_named_in_exactly_one_layer():
    g = graph()
    assert "deltaserve.session.turns" in g and "tools.bench.run" in g and "deltaserve.frontends.cli" in g
    misplaced = {m: len(layers_of(m)) for m in g if len(layers_of(m)) != 1}
    assert not misplaced, f"modules named in no layer or in several (place each in LAYERS once): {misplaced}"


def test_no_module_imports_a_layer_above_its_own():
    found = upward(graph())
    assert not found, "imports that run upward:\n" + "\n".join(found)


def test_the_repository_imports_one_another_without_a_cycle_the_bench_included():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)
    assert not any(t.startswith("tools.") for t in graph()["deltaserve.frontends.cli"])  # the bench is its own program


# what a frontend may import below its own layer: the API facade (deltaserve.api and its layer's modules), the turn
# modules (the pipeline and its driver) and the errors
FRONTEND_DOORS = ("deltaserve.session.turns", "deltaserve.session.driver", "deltaserve.errors")


def frontend_reaches(g: dict[str, set[str]]) -> list[str]:
    api = dict(LAYERS)["api"]
    out = []
    for mod, targets in sorted(g.items()):
        if layer_of(mod) != layer_of("deltaserve.frontends.cli") or mod == "deltaserve":  # the package's root: its
            continue                                                                         # version, lazily `load`
        for t in sorted(targets):
            if t in g and layer_of(t) < layer_of(mod) and t not in FRONTEND_DOORS and not any(matches(e, t) for e in api):
                out.append(f"{mod} imports {t}")
    return out


def test_the_frontends_import_only_the_api_facade_the_turn_modules_and_the_errors():
    found = frontend_reaches(graph())
    assert not found, "frontends reaching past the API facade (name it in deltaserve.api):\n" + "\n".join(found)


def test_the_checker_finds_an_upward_import_and_a_real_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from pkg.high import b\n")          # upward, and half a cycle
    (pkg / "high" / "b.py").write_text("def f():\n    from pkg.low import a\n")  # a function-level import closes it
    (pkg / "low" / "c.py").write_text("from . import a\n")                  # a relative import, same layer
    trees = {"pkg": pkg}
    layers = [("low", ["pkg.low.*", "pkg"]), ("high", ["pkg.high.*"])]
    g = graph(trees)
    assert g["pkg.low.a"] == {"pkg.high.b"} and g["pkg.high.b"] == {"pkg.low.a"} and g["pkg.low.c"] == {"pkg.low.a"}
    assert upward(g, layers) == ["pkg.low.a (low) imports pkg.high.b (high)"]
    assert cycles(g) == [["pkg.high.b", "pkg.low.a"]]
    (pkg / "high" / "b.py").write_text("x = 1\n")  # the cycle broken: none is found
    assert cycles(graph(trees)) == []
    assert layers_of("pkg.elsewhere", [("x", ["pkg.low.*"])]) == []  # no catch-all: an unplaced module is unplaced
    assert len(layers_of("pkg.low.a", [("x", ["pkg.low.*"]), ("y", ["pkg.low.a"])])) == 2


def test_no_environment_variable_is_read_outside_the_settings_module():
    """deltaserve.settings declares every variable and reads them once; elsewhere os.environ is only written
    (setdefault for torch's and Ray's own variables) or copied whole for a child process."""
    reads = []
    for path in sorted(TREES["deltaserve"].rglob("*.py")):
        if path.name == "settings.py" and path.parent == TREES["deltaserve"]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            env = lambda n: isinstance(n, ast.Attribute) and n.attr == "environ"  # noqa: E731
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("get", "pop", "__getitem__") and env(node.func.value):
                    reads.append(f"{path.name}:{node.lineno}")
                if node.func.attr == "getenv":
                    reads.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Subscript) and env(node.value) and isinstance(node.ctx, ast.Load):
                reads.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Compare) and any(env(c) for c in node.comparators):
                reads.append(f"{path.name}:{node.lineno}")
    assert not reads, f"environment read outside deltaserve/settings.py: {reads}"
    from deltaserve import settings

    s = settings.read({"DELTASERVE_PREFILL": "F32", "DELTASERVE_PREFILL_TOKENS": "on", "DELTASERVE_NATIVE": "off"})
    assert (s.prefill, s.prefill_tokens, s.native, s.device) == ("f32", True, False, "auto")
