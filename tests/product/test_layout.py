"""The architecture as the folders show it, checked on every import
statement of the package, those inside functions (lazy imports) included:
the ML core imports nothing from the run's lifecycle, the process
plumbing or the cluster, neither of these from the lifecycle or each
other, and no module imports itself back through others. And the tests as
their folders show them: in the folder of what each tests."""

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import distributed_mpt

PACKAGE = Path(distributed_mpt.__file__).parent
# What each layer may import of the package, besides itself.
LEAVES = {"distributed_mpt.errors", "distributed_mpt.files", "distributed_mpt.json_lines",
          "distributed_mpt.options"}
ALLOWED = {
    "distributed_mpt.core": LEAVES,
    "distributed_mpt.process": LEAVES,
    "distributed_mpt.cluster": LEAVES,
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
    import name` counts as X.name where that is a module, else X; a relative
    import (`from ..training import run`) as the absolute one it means."""
    name = next(module for module, file in modules.items() if file == path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                imported.add(submodule if submodule in modules else base)
    return {name for name in imported if name in modules}


def _graph() -> dict:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_the_core_the_plumbing_and_the_cluster_import_only_themselves_and_the_leaves():
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
    # The check above is only as good as the edges it finds: classifier.py imports
    # the core's models inside a function.
    assert "distributed_mpt.core.models" in _graph()["distributed_mpt.classifier"]


def test_the_walk_sees_relative_imports(tmp_path):
    # `from ...training import run` inside the core is the import the rules
    # forbid, written another way.
    core = tmp_path / "distributed_mpt" / "core" / "models"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("from . import mine\n")
    (core / "mine.py").write_text("def f():\n    from ...training import run\n")
    modules = {"distributed_mpt.core.models": core / "__init__.py",
               "distributed_mpt.core.models.mine": core / "mine.py",
               "distributed_mpt.training.run": tmp_path / "run.py"}
    assert _imports(core / "mine.py", modules) == {"distributed_mpt.training.run"}
    assert _imports(core / "__init__.py", modules) == {"distributed_mpt.core.models.mine"}


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
    # are not counted: a section's fields are its options, each a flag.
    wide = {f"{path.relative_to(PACKAGE)}:{node.name}": n for path in PACKAGE.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            if (n := _init_parameters(node)) > 8}
    assert not wide, wide


# The training step as a reader follows it, from the compiled loop down to
# the update rules, in reading order (docs/architecture.md, "One training
# step"): at most 3 files, about 600 lines, and no evaluation among them.
TRAIN_STEP = ["core/steps.py", "core/optim/optimizer.py", "core/optim/rules.py"]
TRAIN_STEP_LINES = 600


def _step_parts(tree: ast.AST) -> set:
    """What of the training step a module defines: "step" (it calls
    apply_gradients), "optimizer" (a Keras optimizer's update_step), "rule"
    (an UpdateRule subclass)."""
    parts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "apply_gradients":
            parts.add("step")
        elif isinstance(node, ast.FunctionDef) and node.name == "update_step":
            parts.add("optimizer")
        elif isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "UpdateRule"
                                                    for b in node.bases):
            parts.add("rule")
    return parts


def _evaluation(tree: ast.AST) -> list:
    """Where a module evaluates: calls of a model with training=False, and
    functions named for evaluation or prediction that do more than hand it on
    (one statement after the docstring)."""
    found = [f"line {node.lineno}: training=False" for node in ast.walk(tree)
             if isinstance(node, ast.Call) and any(
                 k.arg == "training" and getattr(k.value, "value", None) is False
                 for k in node.keywords)]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and re.search("eval|predict", node.name):
            body = [s for s in node.body if not (isinstance(s, ast.Expr)
                                                 and isinstance(s.value, ast.Constant))]
            if len(body) > 1:
                found.append(f"line {node.lineno}: {node.name}")
    return found


def test_the_training_step_reads_in_at_most_3_files_of_about_600_lines():
    trees = {str(path.relative_to(PACKAGE)): ast.parse(path.read_text())
             for path in PACKAGE.rglob("*.py")}
    holders = {name: parts for name, tree in trees.items() if (parts := _step_parts(tree))}
    assert {"step", "optimizer", "rule"} <= set().union(*holders.values()), holders
    outside = sorted(set(holders) - set(TRAIN_STEP))
    assert not outside, f"parts of the step outside TRAIN_STEP: {outside}"
    lines = {name: len((PACKAGE / name).read_text().splitlines()) for name in TRAIN_STEP}
    assert len(TRAIN_STEP) <= 3 and sum(lines.values()) <= TRAIN_STEP_LINES, lines
    evaluation = {name: where for name in TRAIN_STEP if (where := _evaluation(trees[name]))}
    assert not evaluation, f"evaluation is not the training step: {evaluation}"


def test_the_architecture_names_the_steps_files_in_reading_order_with_their_lines():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    paragraph = text[text.index("**One training step.**"):].split("\n\n")[0]
    named = re.findall(r"`(core/[\w/]+\.py)`\s+\((\d+)\s+lines", paragraph)
    assert [name for name, _ in named] == TRAIN_STEP, paragraph
    for name, stated in named:
        actual = len((PACKAGE / name).read_text().splitlines())
        assert abs(int(stated) - actual) <= 0.1 * actual, f"{name}: {stated} lines, is {actual}"


TESTS = Path(__file__).resolve().parents[1]
# The folders of tests/ that are no folder of the package (pytest.ini says
# what each holds); every other folder is named after one of the package's.
TEST_FOLDERS_OF_THEIR_OWN = {"entry_points", "k8s", "leaves", "product", "support"}


def test_every_test_lives_in_a_folder_named_after_what_it_tests():
    at_the_root = sorted(path.name for path in TESTS.glob("test_*.py"))
    assert not at_the_root, f"tests/ holds {at_the_root}: move each into the folder of what it tests"
    package_folders = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    folders = {path.name for path in TESTS.iterdir()  # not __pycache__, .pytest_cache
               if path.is_dir() and not path.name.startswith(("_", "."))}
    assert folders - package_folders <= TEST_FOLDERS_OF_THEIR_OWN, sorted(
        folders - package_folders - TEST_FOLDERS_OF_THEIR_OWN)
    # Without __init__.py, pytest imports a test file by its name alone: two
    # files of one name in different folders would collide.
    names = [path.name for path in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


# Settings in sections, each read by the part that declares it
# (docs/architecture.md, "Settings"): a section is a class of Options; its
# part is the folder of the module that declares it (the folder's own
# modules, not those of its subfolders); config.py composes the sections and
# holds the rules across them. Reads outside a part, each with its reason:
READERS = {
    # The names of what a run trains, in its first line and summary.json.
    ("data", "dataset"): {"distributed_mpt.training.run", "distributed_mpt.predict"},
    # refuse_other_data names the directory whose images differ.
    ("data", "data_dir"): {"distributed_mpt.training.plan"},
    # The loss's, which StepRules takes with the other numbers of the step.
    ("optimizer", "label_smoothing"): {"distributed_mpt.training.build"},
    # predict rebuilds a run's model (classifier.py) and its test split from the run's record.
    **{key: {"distributed_mpt.classifier"} for key in (
        ("model", "model"), ("model", "model_width"), ("run", "precision"))},
    ("run", "seed"): {"distributed_mpt.predict"},
}
COMPOSER = "distributed_mpt.config"


def _sections() -> dict:
    """{section name in TrainConfig: (the module declaring its class, its fields)}."""
    trees = {name: ast.parse(path.read_text()) for name, path in _modules().items()}
    declared = {node.name: (module, {item.target.id for item in node.body
                                     if isinstance(item, ast.AnnAssign)})
                for module, tree in trees.items() for node in ast.walk(tree)
                if isinstance(node, ast.ClassDef)
                and any(getattr(base, "id", "") == "Options" for base in node.bases)}
    config = next(node for node in ast.walk(trees[COMPOSER])
                  if isinstance(node, ast.ClassDef) and node.name == "TrainConfig")
    return {item.target.id: declared[item.annotation.id] for item in config.body
            if isinstance(item, ast.AnnAssign)}


def _part(module: str, modules: dict) -> str:
    """The folder (as a package name) that `module` belongs to."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def _of_a_config(node: ast.AST, sections: dict) -> bool:
    """Whether `node` is `<a config>.<section>` (`config.muon`, `self._config.run`),
    not an attribute that shares a section's name (a trainer's `optimizer`)."""
    holder = getattr(node, "value", None)
    name = getattr(holder, "id", None) or getattr(holder, "attr", "")
    return getattr(node, "attr", None) in sections and "config" in name


def _section_reads(tree: ast.AST, sections: dict, classes: dict) -> set:
    """(section, field) of every read in `tree`: `<expr>.<section>.<field>`,
    `<name>.<field>` where the name holds a section (`x = <expr>.<section>`,
    or an argument annotated with its class, `classes`: {class: section}),
    and `<expr>.flags()["<field>"]`."""
    held = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            # `x = a.section`, and `x, y = a.section, ...` as the code writes it.
            pairs = [(target, node.value) for target in node.targets]
            pairs += [pair for target in node.targets if isinstance(target, ast.Tuple)
                      and isinstance(node.value, ast.Tuple)
                      for pair in zip(target.elts, node.value.elts)]
            held.update((target.id, value.attr) for target, value in pairs
                        if isinstance(target, ast.Name) and _of_a_config(value, sections))
        elif isinstance(node, ast.arg) and getattr(node.annotation, "id", None) in classes:
            held[node.arg] = classes[node.annotation.id]
    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            holder = node.value
            section = (holder.attr if isinstance(holder, ast.Attribute) else
                       held.get(holder.id) if isinstance(holder, ast.Name) else None)
            if section in sections and node.attr in sections[section][1]:
                reads.add((section, node.attr))
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call)
              and getattr(node.value.func, "attr", "") == "flags"
              and isinstance(node.slice, ast.Constant)):
            reads |= {(name, node.slice.value) for name, (_, fields) in sections.items()
                      if node.slice.value in fields}
    return reads


def _ownership_breaches() -> list:
    modules, sections = _modules(), _sections()
    classes = {node.name: name for name, (module, fields) in sections.items()
               for node in ast.walk(ast.parse(modules[module].read_text()))
               if isinstance(node, ast.ClassDef) and fields == {
                   item.target.id for item in node.body if isinstance(item, ast.AnnAssign)}}
    breaches = []
    for module, path in modules.items():
        if module == COMPOSER:
            continue
        for section, field in sorted(_section_reads(ast.parse(path.read_text()), sections,
                                                    classes)):
            owner = _part(sections[section][0], modules)
            if _part(module, modules) != owner and module not in READERS.get((section, field), ()):
                breaches.append(f"{module} reads {section}.{field} (owned by {owner})")
    return breaches


def test_every_section_is_read_only_by_its_part():
    assert set(_sections()) == {"run", "data", "model", "airbench", "optimizer", "muon",
                                "schedule", "augmentation", "evaluation", "cluster"}
    breaches = _ownership_breaches()
    assert not breaches, "\n".join(breaches)


def test_the_ownership_check_sees_a_read_outside_the_part(monkeypatch):
    # A check that cannot fail is no check: Muon's momentum read where the
    # run is built, as training/build.py did before the sections.
    build = PACKAGE / "training" / "build.py"
    leak = build.read_text() + "\n\ndef _leak(config):\n    return config.muon.muon_momentum\n"
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: leak if self == build
                        else original(self, *a, **k))
    assert _ownership_breaches() == ["distributed_mpt.training.build reads muon.muon_momentum "
                                     "(owned by distributed_mpt.core.optim)"]
    # A section held in a name, given as an argument, or read flat.
    sections = _sections()
    for code, read in (("options = config.cluster\noptions.cpu_replicas", ("cluster", "cpu_replicas")),
                       ("o, n = config.muon, 1\no.muon_momentum", ("muon", "muon_momentum")),
                       ("def f(o: MuonOptions):\n    return o.muon_momentum", ("muon", "muon_momentum")),
                       ("config.flags()['whiten_images']", ("airbench", "whiten_images"))):
        assert _section_reads(ast.parse(code), sections, {"MuonOptions": "muon"}) == {read}, code
