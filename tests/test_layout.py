"""The architecture as the folders show it, checked on every import
statement of the package, those inside functions (lazy imports) included:
the ML core imports nothing from the run's lifecycle or the process
plumbing, the plumbing nothing from the lifecycle, and no module imports
itself back through others."""

import ast
import subprocess
import sys
from pathlib import Path

import distributed_mpt

PACKAGE = Path(distributed_mpt.__file__).parent
# What each layer may import of the package, besides itself.
LEAVES = {"distributed_mpt.errors", "distributed_mpt.files"}
ALLOWED = {
    "distributed_mpt.core": LEAVES,
    "distributed_mpt.process": LEAVES,
}


def _modules() -> dict:
    """{module name: its file} for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path, modules: dict) -> set:
    """The package's modules that `path` imports, anywhere in it: `from X
    import name` counts as X.name where that is a module, else X."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                imported.add(submodule if submodule in modules else node.module)
    return {name for name in imported if name in modules}


def _graph() -> dict:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_the_core_and_the_plumbing_import_only_themselves_and_the_leaves():
    graph = _graph()
    breaches = []
    for layer, allowed in ALLOWED.items():
        for module, imported in graph.items():
            if module == layer or module.startswith(layer + "."):
                breaches += [f"{module} imports {other}" for other in imported
                             if not (other == layer or other.startswith(layer + ".")
                                     or other in allowed)]
    assert not breaches, "\n".join(sorted(breaches))


def test_no_import_cycle_lazy_imports_included():
    graph = _graph()
    cycles, state = [], {}  # state: 1 on the path, 2 done

    def visit(module, path):
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycles.append(" -> ".join(path[path.index(other):] + [other]))
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_walk_sees_lazy_imports():
    # The check above is only as good as the edges it finds: predict imports
    # the core's models inside a function.
    assert "distributed_mpt.core.models" in _graph()["distributed_mpt.predict"]


def test_no_module_is_over_400_lines():
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long


def test_training_holds_at_most_6_modules():
    # One run's code, named by what a reader looks for (plan, build, loop,
    # checkpoints, outputs, run): it was 11 modules, read together.
    modules = sorted(path.name for path in (PACKAGE / "training").glob("*.py")
                     if path.name != "__init__.py")
    assert len(modules) <= 6, modules


def _heavy_imports(module: str) -> list:
    """Which of TensorFlow and Keras a fresh interpreter holds after
    importing `module` of this checkout."""
    probe = (f"import sys, {module}; "
             f"print(*sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=300, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()[-1].split()


def test_importing_the_run_imports_neither_tensorflow_nor_keras():
    # training/run.py checks and locks --model_dir before TensorFlow starts
    # (MultiWorkerMirroredStrategy must come before any other TensorFlow op,
    # and a refusal should cost nothing): it imports TensorFlow, and the
    # modules that do, only inside its functions.
    assert _heavy_imports("distributed_mpt.training.run") == []
    # The probe sees an import where there is one.
    assert _heavy_imports("distributed_mpt.training.loop") == ["keras", "tensorflow"]


def _init_parameters(cls: ast.ClassDef) -> int:
    """How many arguments the class's own __init__ takes (self not counted);
    0 for a class without one."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            arguments = node.args
            return len(arguments.posonlyargs) + len(arguments.args) - 1 + len(arguments.kwonlyargs)
    return 0


def test_no_class_takes_more_than_8_constructor_parameters():
    # A class that needs more does several things: its settings go in
    # records of their own (core/steps.py's Trainer takes StepRules). The
    # records themselves (dataclasses, whose fields are their parameters)
    # are not counted: TrainConfig's flat fields are settings not yet in
    # sections, which this rule does not settle.
    wide = {f"{path.relative_to(PACKAGE)}:{node.name}": n for path in PACKAGE.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            if (n := _init_parameters(node)) > 8}
    assert not wide, wide
