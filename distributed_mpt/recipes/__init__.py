"""The shipped recipes: flagfiles that say what they reach, where, and how
fast. `--recipe=NAME` reads `NAME.flags` from here, from any working
directory and for an installed package alike."""

from importlib import resources

from distributed_mpt.errors import ConfigError

_DIRECTORY = resources.files(__name__)
# CIFAR-10's train split, on which the recipes train: the projection's batch
# rule (benchmark/scaling.py) and an unfinished run's time to the end (render.py).
CIFAR10_TRAIN_EXAMPLES = 50_000


def names() -> list:
    """The names of the shipped recipes, sorted."""
    return sorted(p.name[:-len(".flags")] for p in _DIRECTORY.iterdir()
                  if p.name.endswith(".flags"))


def path(name: str) -> str:
    """The flagfile of recipe `name`; ConfigError if there is none. Names
    only: `../../x` names no recipe, it does not reach outside this
    directory."""
    if name not in names():
        raise ConfigError(f"--recipe={name} is not one of the shipped recipes: "
                          f"{', '.join(names())}")
    return str(_DIRECTORY / f"{name}.flags")


def summary(name: str) -> str:
    """Recipe `name` in one line: the first line of its header."""
    with open(path(name)) as f:
        return f.readline().lstrip("# ").strip()


def measured(name: str) -> str:
    """What recipe `name` reached: its header's "# Measured" lines, which the
    results ledger renders (render.py), in one paragraph."""
    with open(path(name)) as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("# Measured")), None)
    if start is None:
        return "not measured"
    return " ".join(line[4:] for line in lines[start + 1:] if line.startswith("#   "))


def flags(name: str) -> list:
    """The flags recipe `name` sets, as its file gives them."""
    with open(path(name)) as f:
        return [line.strip() for line in f if line.startswith("--")]


def describe_all() -> str:
    """Every recipe: what it is, what it reached and what it sets (for --help)."""
    import textwrap

    parts = ["Recipes (--recipe=NAME; flags given explicitly override the recipe's):"]
    for name in names():
        parts.append(f"  {name}: {summary(name)}")
        parts += textwrap.wrap("Measured: " + measured(name), 80, initial_indent="    ",
                               subsequent_indent="      ")
        parts += textwrap.wrap("Sets: " + " ".join(flags(name)), 80, initial_indent="    ",
                               subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(parts)
