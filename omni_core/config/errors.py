"""Config errors: every problem names its key path, the value given and the fix.

All problems of one config are collected and raised together as one `ConfigError`, so a user
fixes a config in one round instead of one error at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_UNSET = object()


@dataclass(frozen=True)
class ConfigProblem:
    """One problem: the dotted key path, the value given (if any) and what is wrong / how to fix it."""

    key: str
    message: str
    value: Any = _UNSET

    def __str__(self) -> str:
        if self.value is _UNSET:
            return f"{self.key}: {self.message}"
        return f"{self.key}={_show(self.value)}: {self.message}"


class ConfigError(ValueError):
    """An invalid OmniFlow config; `problems` lists every problem found."""

    def __init__(self, problems: list[ConfigProblem]):
        self.problems = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid OmniFlow config ({n} problem{'s' if n != 1 else ''}):\n{lines}")

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.problems]


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)
