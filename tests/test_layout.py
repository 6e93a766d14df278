"""The package's shape: layers whose imports all point down, no cycles, no labs import hidden in a function
(except the CLI's dispatch, which imports a command's modules only when it runs), modules kept small."""
import ast
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parent.parent / "labs"
# Bottom to top. A module may import its own layer's modules or any layer below, never one above.
LAYERS = [
    ("core", ["labs", "labs.errors", "labs.table", "labs.env", "labs.config", "labs.models", "labs.resolve",
              "labs.data", "labs.metrics", "labs.runfolder", "labs.supervisor", "labs.prefork_server", "labs.prefork",
              "labs.multinode", "labs.rendezvous", "labs.remote_env", "labs.peers", "labs.model_folder",
              "labs.network", "labs.checkpoint", "labs.cpu_matmul", "labs.fsdp", "labs.zenflow_layout", "labs.zenflow_host",
              "labs.zenflow_columns", "labs.zenflow_moments", "labs.card_cap", "labs.offload_copy",
              "labs.train"]),
    ("memory", ["labs.memory"]),
    # The launcher asks the memory model whether a run can fit before starting any rank: it sits above it.
    ("run", ["labs.preflight", "labs.resume", "labs.runcache", "labs.launch", "labs.export"]),
    ("instruments", ["labs.instruments"]),
    ("bench", ["labs.bench"]),
    ("course", ["labs.course"]),
    ("entry points", ["labs.cli", "labs.rank", "labs.fork_launcher", "labs.__main__"]),
]
FUNCTION_LEVEL_ALLOWED = {"labs.cli", "labs.__main__"}   # the command line: each command imports what it runs


def _modules() -> dict[str, Path]:
    found = {}
    for path in LABS.rglob("*.py"):
        name = ".".join(path.relative_to(LABS.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "labs" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _imports(module: str):
    """(imported labs module, inside a function?) for every import statement of `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    inner = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn)}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            if name in MODULES and name != module:
                yield name, id(node) in inner


def test_every_module_has_a_layer_and_imports_point_down():
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
              for m in MODULES for t, _ in _imports(m) if _layer(t) > _layer(m)]
    assert not upward, upward


def test_no_function_level_labs_imports_outside_the_cli():
    hidden = [f"{m} -> {t}" for m in MODULES if m not in FUNCTION_LEVEL_ALLOWED for t, inner in _imports(m) if inner]
    assert not hidden, hidden


def test_no_import_cycles():
    graph = {m: {t for t, _ in _imports(m)} for m in MODULES}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for target in graph[node]:
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= 300, f"{module} has {lines} lines: split it by concern"


def test_the_launcher_and_the_instruments_name_the_same_instruments():
    from labs import instruments, launch

    assert set(launch.INSTRUMENTS) == set(instruments.INSTRUMENTS)


def test_the_readme_layout_table_lists_every_module():
    readme = (LABS.parent / "README.md").read_text()
    missing = [m for m in MODULES if m != "labs" and f"`{m.removeprefix('labs.')}`" not in readme]
    assert not missing, missing
