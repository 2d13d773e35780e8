"""What a network is made of, so that a resumed run, predict from a
checkpoint and the workers of one job can tell whether they hold the
network a run trained: one signature for all three.

A signature records the network's variables (names, shapes and dtypes)
and, for a user's model, the source that builds it: what can change the
network without changing its variables (an activation, a stride, a
dropout rate). That source is the builder function with the functions
and classes of its file that it uses by name (and those use, and so on),
every other top-level statement of the file (each runs as the file is
imported, and any may change a value the builder uses:
`SETTINGS["activation"] = "gelu"`), and the whole of every module these
import from its folder or below, each compared as its syntax tree:
without comments, docstrings or formatting. A comment anywhere, or an
edit to a function or class of the file that the builder does not use,
changes nothing; an edit to any other top-level statement, a value the
builder does not read included, is a change.
The package's own models are recorded by name, as its release fixes them.

A run recorded before signatures existed holds the SHA-256 of its whole
model file (`model_source`): it is compared as it was recorded.
"""

import ast
import hashlib
import importlib.util
import json
import math
import os
import re
import site
import sys
from typing import Dict, Iterable, List, Optional

from distributed_mpt.core.models import ModelSpec, _locate
from distributed_mpt.core.models.contract import ModelError
from distributed_mpt.errors import CheckpointMismatchError, quoted

# This package's own folder: its modules are its release's, not the user's.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


# Which top-level statements of a model's file its source digest holds:
# 1, those binding a name the builder uses (runs recorded before 2026-12-06);
# 2, every one that runs on import (_used_statements). A run recorded under
# 1 is compared under 1: an unused import would otherwise refuse its resume.
SOURCE_RULE = 2


class ModelChangedError(CheckpointMismatchError):
    """The network is not the one the run in --model_dir trained."""


def model_signature(spec: ModelSpec, model) -> dict:
    """The signature of `model`, built from `spec`, as config.json records
    it: {"model", "variables" (a digest), "parameters", and for a user's
    model "source": {the builder's name or a module's path: its digest} and
    "source_rule" (SOURCE_RULE)}."""
    signature = {"model": spec.identity}
    if spec.is_users:
        signature["source"], signature["source_rule"] = _source(spec), SOURCE_RULE
    # Keras numbers the layers it names per process (dense, dense_1, ...):
    # the same network built after another must get the same names.
    names = [f"{re.sub(r'_[0-9]+(?=/|$)', '', v.path)} {list(v.shape)} {v.dtype}"
             for v in model.weights]
    signature["variables"] = _digest("\n".join(names))
    signature["parameters"] = sum(math.prod(v.shape) for v in model.weights)
    return signature


def fingerprint(signature: dict) -> str:
    """The signature in a few characters, for workers to compare."""
    return f"{signature['model']} {_digest(json.dumps(signature, sort_keys=True))[:16]}"


def refuse_another_model(recorded: dict, signature: dict, spec: ModelSpec, run: str,
                         remedy: str) -> None:
    """Raises ModelChangedError unless `signature` is that of the network
    the run whose config.json "resolved" section is `recorded` trained
    (`run` names it, `remedy` says what to do); nothing recorded, nothing
    to compare."""
    if "model_signature" in recorded:
        then = recorded["model_signature"]
        if isinstance(then, dict) and "source" in then and "source_rule" not in then:
            signature = {**signature, "source": _source(spec, rule=1)}  # recorded so
        differences = _differences(then, signature)
    elif "model_source" in recorded and spec.is_users:  # a built-in's was its name: the
        now = _file_digest(_locate(spec.builder)[0])     # checkpoint's identity compares that
        differences = [] if recorded["model_source"] == now else [
            "its file's SHA-256 differs (that run recorded the whole file, as runs did before "
            "model signatures: any edit counts)"]
    else:
        return
    if differences:
        raise ModelChangedError(f"--model={quoted(spec.name)} is not the network {run} trained: "
                                f"{'; '.join(differences)}: {remedy}")


def _differences(then, now: dict) -> List[str]:
    """What differs between a recorded signature (untrusted: it comes from
    a file in --model_dir) and this one, in words."""
    if not isinstance(then, dict):
        return ["its record in config.json is not what this program writes"]
    found = []
    sources = then.get("source") if isinstance(then.get("source"), dict) else {}
    changed = sorted(set(sources) ^ set(now.get("source", {})) |
                     {name for name, digest in now.get("source", {}).items()
                      if sources.get(name, digest) != digest})
    if changed:
        found.append("the source of " + ", ".join(
            quoted(name, 60) if name.endswith(".py") else
            f"{quoted(name, 60)} (and of what it uses of its file)" for name in changed[:5])
            + " differs")
    if then.get("variables") != now["variables"]:
        parameters = then.get("parameters")
        found.append(f"its variables differ (names, shapes or dtypes; "
                     f"{parameters if isinstance(parameters, int) else '?'} parameters then, "
                     f"{now['parameters']} now)")
    return found


def _source(spec: ModelSpec, rule: int = SOURCE_RULE) -> Dict[str, str]:
    """A user's model's source digests (_source_digests) under `rule`."""
    path, function = _locate(spec.builder)
    module = sys.modules.get(spec.builder.rpartition(":")[0])  # package.module:function
    package = module.__spec__.parent if module and module.__spec__ else None
    try:
        return _source_digests(spec.name, path, function, package, rule)
    except RecursionError:  # Python compiles deeper trees than its own recursion walks
        raise ModelError(f"--model={quoted(spec.name)}: its source nests too deep to record "
                         f"what the network is made of (generated code: an expression of "
                         f"thousands of terms?); write it as a loop or a list") from None


def _source_digests(name: str, path: str, function: str, package: Optional[str],
                    rule: int = SOURCE_RULE) -> Dict[str, str]:
    """{function: the digest of the builder and what else of its file makes
    it (`path`, of `package` if a module's: _used_statements), each module
    those import from the file's folder: its digest}, the modules named by
    their path relative to that folder."""
    folder = os.path.dirname(os.path.realpath(path))
    used = _used_statements(_parse(name, path), function, rule)
    digests = {function: _digest("\n".join(ast.dump(statement) for statement in used))}
    todo, seen = [(used, package)], {os.path.realpath(path)}
    while todo:
        statements, package = todo.pop()
        for module in _imported_modules(statements, package):
            file = getattr(module, "__file__", None)
            file = os.path.realpath(file) if file else None
            if not file or file in seen or not _is_users(file, folder):
                continue
            seen.add(file)
            if file.endswith(".py"):
                helper = _parse(name, file)
                digests[os.path.relpath(file, folder)] = _digest(ast.dump(helper))
                todo.append((helper.body, module.__spec__.parent if module.__spec__ else None))
            else:  # a compiled module: its bytes
                digests[os.path.relpath(file, folder)] = _file_digest(file)
    return digests


def _parse(name: str, path: str) -> ast.Module:
    """The syntax tree of the file at `path`, its docstrings dropped."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError) as e:
        raise ModelError(f"--model={quoted(name)}: cannot read {quoted(path)} again, to record "
                         f"what the network is made of ({type(e).__name__}: {quoted(e)})") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def _used_statements(tree: ast.Module, name: str, rule: int = SOURCE_RULE) -> List[ast.stmt]:
    """The top-level statements of `tree` that make what the function
    `name` builds, in the file's order: every one that runs as the file is
    imported, as any may change a value the function uses
    (`SETTINGS["activation"] = "gelu"`, `LAYERS.append(...)`, a call that
    does), and of the functions and classes, the one named `name` and those
    the statements taken use by name, and so on. A bare constant (a string
    as a comment) and an `if __name__ == "__main__":` block do nothing as
    the package imports the file: they are left out. What runs as an unused
    function or class is defined (a decorator, a default value, a class
    body) is not followed: a body runs when it is called. Under SOURCE_RULE
    1, only the statements binding a name taken, from `name` on."""
    defining, taken = {}, set()
    for statement in tree.body:
        if rule == 1:
            for bound in _bound_names(statement):
                defining.setdefault(bound, []).append(statement)
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defining.setdefault(statement.name, []).append(statement)
        elif _runs(statement):
            taken.add(id(statement))
    todo = [name] + [node.id for statement in tree.body if id(statement) in taken
                     for node in ast.walk(statement) if isinstance(node, ast.Name)]
    while todo:
        for statement in defining.get(todo.pop(), []):
            if id(statement) not in taken:
                taken.add(id(statement))
                todo += [node.id for node in ast.walk(statement) if isinstance(node, ast.Name)]
    return [statement for statement in tree.body if id(statement) in taken]


def _bound_names(statement: ast.stmt) -> Iterable[str]:
    """The module-level names a top-level statement binds (a function or
    class: its name, not its locals): SOURCE_RULE 1's."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield statement.name
    elif isinstance(statement, (ast.Import, ast.ImportFrom)):
        for alias in statement.names:
            yield alias.asname or alias.name.split(".")[0]
    else:
        for child in ast.iter_child_nodes(statement):
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                yield child.id
            elif not isinstance(child, ast.Name):  # an `if`'s body, a tuple of targets
                yield from _bound_names(child)


def _runs(statement: ast.stmt) -> bool:
    """Whether a top-level statement other than a def or class does
    anything when the package imports its file (as a module not named
    "__main__")."""
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return False
    test = statement.test if isinstance(statement, ast.If) and not statement.orelse else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return True
    sides = [test.left, *test.comparators]
    return not ([side.id for side in sides if isinstance(side, ast.Name)] == ["__name__"] and
                [side.value for side in sides if isinstance(side, ast.Constant)] == ["__main__"])


def _imported_modules(statements: List[ast.stmt], package: Optional[str]) -> list:
    """The modules (already imported) that import statements anywhere in
    `statements` name: `import a.b` names a and a.b, `from a import b`
    names a and a.b where that is a module."""
    names = set()
    for node in (n for statement in statements for n in ast.walk(statement)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                names |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                try:
                    base = importlib.util.resolve_name("." * node.level + base, package)
                except (ImportError, ValueError):  # a file's relative import: it did not import
                    continue
            names |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return [sys.modules[name] for name in sorted(names) if name in sys.modules]


def _is_users(file: str, folder: str) -> bool:
    """Whether `file` is the user's: in the model file's folder or below,
    and neither installed (a virtualenv in that folder) nor this package."""
    installed = {sys.prefix, sys.base_prefix, sys.exec_prefix, _PACKAGE, site.getusersitepackages()}
    installed.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())

    def within(root):
        return os.path.commonpath([file, root]) == root

    return within(folder) and not any(within(os.path.realpath(r)) for r in installed if r)


def _file_digest(path: str) -> str:
    """The SHA-256 of the whole file: what runs recorded before signatures,
    and a compiled module's."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
