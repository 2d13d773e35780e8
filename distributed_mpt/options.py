"""How each part of the package declares the options it reads: a section, a
frozen dataclass of `option` fields (default, help, choices) that checks
itself when made. Each field is the command-line flag of the same name
(train.py derives them); config.py composes the sections into a run's
TrainConfig. A leaf: every part imports it, without TensorFlow."""

import dataclasses
import math

from distributed_mpt.errors import ConfigError

# Bounds that catch a typo (an extra zero, 10**9) before it becomes an
# out-of-memory crash or a silent hang hours later.
MAX_STEPS = 10**9
MAX_EXAMPLES = 2_000_000  # synthetic images: 3 KB each in memory


def option(default, help: str, choices=None):
    """A section's field that is also a flag: its help text lives here, once."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def require_positive(section, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        require(value > 0, f"--{name}={value} must be a positive integer")


def require_at_most(section, limit, *names: str) -> None:
    """What a run derives from each (steps, rates, a deadline) stays finite."""
    for name in names:
        value = getattr(section, name)
        require(value <= limit, f"--{name}={value} is larger than this program accepts ({limit:,})")


class Options:
    """A section's checks, run when it is made (a config.json read back
    passes no flag parser): every float finite, every choice one of its
    choices, then the section's own `check`."""

    def __post_init__(self):
        fields = dataclasses.fields(self)
        for field in fields:
            value = getattr(self, field.name)
            require(not isinstance(value, float) or math.isfinite(value),
                    f"--{field.name}={value} must be a finite number")
        for field in (field for field in fields if field.metadata["choices"]):
            value, choices = getattr(self, field.name), field.metadata["choices"]
            require(value in choices, f"--{field.name}={value!r} is not one of {', '.join(choices)}")
        self.check()

    def check(self) -> None:
        """Raises ConfigError for a value this section cannot run with."""
