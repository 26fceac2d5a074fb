"""The package's imports form no circle and point only down the layers (DESIGN.md: a call flows
top to bottom, once). Read from the source with ``ast``: every import statement counts, those
inside functions and ``if TYPE_CHECKING:`` blocks too (a function-local import hides a loop, it
does not remove it), and so does ``importlib.import_module`` of a name written out. A name made
at run time (the lazy names of vitrail, vitrail.jit and vitrail.ops, the families and their
benchmarks and problems that vitrail.ops loads) is a plug-in's lookup, not an edge, and is not
seen. Nor does a module take another's private names (one underscore): what it needs is public
there.

Layers, low to high; a module may import its own layer and those below:

  base     vitrail (the package: version, logging), vitrail.knobs
  jit      compile, cache, load and call CUDA C++
  profile  timing (profile.timing: the function measure), peaks, roofline, traces, plots; the tuner
           times through it
  tune     config spaces, settings, the tuning store, the tuner
  op       vitrail.op: an Op binds a config space to kernels and launches
  device   the GPU's facts and limits (in tune's terms: tune.space.Limits)
  plan     plans: an op call's launches recorded and replayed (native: the C++ hit path)
  gemm     GEMM descriptions and the CUTLASS emitter, with their arguments and plans
           (vitrail.gemm, all but its torch ops: vitrail.gemm.ops is in the ops layer)
  bench    the benchmark registry, its rows and report, and the JIT's own benchmarks
  ops      the op library: families, their configs, benchmarks and tuning problems; the GEMM
           family's torch ops (vitrail.gemm.ops, the last stage of vitrail.gemm)
  cli      vitrail.cli and vitrail.doctor, the commands

blocks, vitrail's C++ building blocks (vitrail/include/vitrail/*.cuh), hold no Python: kernels
include them, nothing imports them.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vitrail"

LAYERS = [
    ["vitrail", "vitrail.knobs"],
    ["vitrail.jit"],
    ["vitrail.profile"],
    ["vitrail.tune"],
    ["vitrail.op"],
    ["vitrail.device"],
    ["vitrail.plan"],
    ["vitrail.gemm"],
    ["vitrail.bench"],
    ["vitrail.ops", "vitrail.gemm.ops"],
    ["vitrail.cli", "vitrail.doctor"],
]

# Circles known and kept, each with its reason; a new one fails.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _prefix(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a `from ... import` statement names, a relative one resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")  # relative: from the package the module is in
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _by_name(node: ast.AST) -> str | None:
    """The module an ``importlib.import_module("...")`` call names, written out; else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    arg = node.args[0]
    if called != "import_module" or not isinstance(arg, ast.Constant):
        return None
    return arg.value if isinstance(arg.value, str) else None


def _targets(module: str, path: Path, node: ast.AST, modules: dict) -> list[str]:
    """The vitrail modules an import statement (or an import_module call of a name written out)
    loads, the deepest one each name resolves to."""
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.Call):
        names = [_by_name(node)]
    else:
        prefix = _prefix(module, path, node)
        for a in node.names:  # `from package import submodule` loads the submodule
            full = f"{prefix}.{a.name}"
            names.append(full if full in modules else prefix)
    out = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}, vitrail's modules only."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)) or _by_name(node):
                for target in _targets(module, path, node, modules):
                    graph[module].setdefault(target, node.lineno)
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, layer in enumerate(LAYERS):
        for top in layer:
            if (module == top or module.startswith(top + ".")) and len(top) > best:
                best, rank = len(top), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS (and the docstring)"
    return rank


def test_no_import_circles():
    graph = _graph()
    circles = _circles(graph)
    new = [c for c in circles if frozenset(c) not in KNOWN_CIRCLES]
    described = ["; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in sorted(c)
                           for b in sorted(graph[a]) if b in c) for c in new]
    assert not new, "import circles:\n" + "\n".join(described)
    gone = KNOWN_CIRCLES - {frozenset(c) for c in circles}
    assert not gone, f"gone, drop them: {sorted(map(sorted, gone))}"


def test_imports_point_down_the_layers():
    graph = _graph()
    upward = [f"{a} (layer {LAYERS[_layer(a)][0]}) imports {b} (layer {LAYERS[_layer(b)][0]}) "
              f"at line {line}"
              for a, targets in sorted(graph.items()) for b, line in sorted(targets.items())
              if _layer(b) > _layer(a)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    """The reader counts what a loop hides behind: imports inside functions, relative ones, and
    import_module of a name written out (not one made at run time)."""
    source = ("def f():\n    from vitrail.jit import compiler\n"
              "def g():\n    from . import module\n"
              "h = importlib.import_module('vitrail.jit.compiler')\n"
              "i = importlib.import_module(f'vitrail.jit.{name}')\n")
    tree = ast.parse(source)
    modules = {"vitrail.jit": PACKAGE / "jit" / "__init__.py",
               "vitrail.jit.compiler": PACKAGE / "jit" / "compiler.py",
               "vitrail.jit.module": PACKAGE / "jit" / "module.py",
               "vitrail.jit.kernel": PACKAGE / "jit" / "kernel.py"}
    seen = [t for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) or _by_name(node)
            for t in _targets("vitrail.jit.kernel", modules["vitrail.jit.kernel"], node, modules)]
    assert sorted(seen) == ["vitrail.jit.compiler", "vitrail.jit.compiler", "vitrail.jit.module"]
    assert _circles({"a": {"b": 1}, "b": {"a": 2}, "c": {}}) == [{"a", "b"}]


# Private names one module takes from another, each with its reason; a new one fails.
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


def _private_uses(module: str, path: Path, modules: dict) -> set[tuple[str, str, str]]:
    """(module, the other module, name) for each private name (one underscore) this module
    imports from another vitrail module or reads off one it holds (imported as a module, or
    by importlib.import_module with a literal name)."""
    tree = ast.parse(path.read_text(), str(path))
    held: dict[str, str] = {}  # local name -> the vitrail module it is
    found = set()

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    held[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            prefix = _prefix(module, path, node)
            owner = prefix
            while owner and owner not in modules:
                owner = owner.rpartition(".")[0]
            for a in node.names:
                full = f"{prefix}.{a.name}"
                if full in modules:
                    held[a.asname or a.name] = full
                elif private(a.name) and owner and owner != module:
                    found.add((module, owner, a.name))
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and getattr(node.value.func, "attr", "") == "import_module"
              and node.value.args and isinstance(node.value.args[0], ast.Constant)
              and node.value.args[0].value in modules):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    held[t.id] = node.value.args[0].value
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in held
                and held[node.value.id] != module):
            found.add((module, held[node.value.id], node.attr))
    return found


def test_no_module_takes_another_modules_private_names():
    """A name one module needs from another is public there (no underscore): a private one is
    the other module's to change."""
    modules = _modules()
    found = set().union(*(_private_uses(m, p, modules) for m, p in modules.items()))
    new = sorted(found - KNOWN_PRIVATE)
    assert not new, "private names taken across modules:\n" + "\n".join(
        f"{a} takes {b}.{n}" for a, b, n in new)
    assert not KNOWN_PRIVATE - found, f"gone, drop them: {sorted(KNOWN_PRIVATE - found)}"


def test_the_private_name_check_sees_each_way_in(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import importlib\nimport vitrail.jit.compiler as c\n"
                    "from vitrail.jit import module, _x\n"
                    "pkg = importlib.import_module('vitrail.jit')\n"
                    "def f():\n    return c._a, module._b, pkg._c, pkg.__name__, c.public\n")
    modules = {"vitrail.jit": PACKAGE / "jit" / "__init__.py",
               "vitrail.jit.compiler": PACKAGE / "jit" / "compiler.py",
               "vitrail.jit.module": PACKAGE / "jit" / "module.py",
               "vitrail.jit.kernel": PACKAGE / "jit" / "kernel.py"}
    assert _private_uses("vitrail.jit.kernel", path, modules) == {
        ("vitrail.jit.kernel", "vitrail.jit", "_x"),
        ("vitrail.jit.kernel", "vitrail.jit.compiler", "_a"),
        ("vitrail.jit.kernel", "vitrail.jit.module", "_b"),
        ("vitrail.jit.kernel", "vitrail.jit", "_c")}
