"""The shipped recipes: flagfiles that say what they reach, where, and how
fast. `--recipe=NAME` reads `NAME.flags` from here, from any working
directory and for an installed package alike."""

from importlib import resources

from distributed_mpt.errors import ConfigError

_DIRECTORY = resources.files(__name__)


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
