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


def describe_all() -> str:
    """Every recipe: what it is (its header's first line), what it reached
    (its "# Measured" lines, which the results ledger renders: render.py)
    and what it sets (for --help)."""
    import textwrap

    parts = ["Recipes (--recipe=NAME; flags given explicitly override the recipe's):"]
    for name in names():
        with open(path(name)) as f:
            lines = f.read().splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("# Measured")), None)
        measured = "not measured" if start is None else \
            " ".join(line[4:] for line in lines[start + 1:] if line.startswith("#   "))
        parts.append(f"  {name}: {lines[0].lstrip('# ').strip()}")
        parts += textwrap.wrap("Measured: " + measured, 80, initial_indent="    ",
                               subsequent_indent="      ")
        parts += textwrap.wrap("Sets: " + " ".join(line.strip() for line in lines
                                                   if line.startswith("--")),
                               80, initial_indent="    ", subsequent_indent="      ",
                               break_on_hyphens=False)
    return "\n".join(parts)
