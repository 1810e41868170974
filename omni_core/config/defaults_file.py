"""The defaults YAML: its values and the comment above each field.

`defaults.yaml` is the single source of every default and every field description: the schema
(`schema.py`) reads both from here, so the Prefect UI form, `omniflow config schema` and the YAML
cannot drift apart. The YAML is plain block-style mappings with a `# comment` line (or several)
directly above each key; this module reads those comments with a small indentation walk, since
PyYAML drops comments.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml

DEFAULTS_PATH = Path(__file__).with_name("defaults.yaml")

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?:\s|$)")


def read_comments(text: str) -> dict[str, str]:
    """Map each dotted key path to the comment lines directly above it (joined by spaces)."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the open mappings
    pending: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = _KEY_LINE.match(line)
        if not match:
            pending = []  # a blank line ends a comment block
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [match["key"]])
        if pending:
            comments[path] = " ".join(pending)
        pending = []
        stack.append((indent, match["key"]))
    return comments


@cache
def load_defaults() -> tuple[dict[str, Any], dict[str, str]]:
    """(default values as nested dicts, comments by dotted key path)."""
    text = DEFAULTS_PATH.read_text()
    return yaml.safe_load(text), read_comments(text)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {dotted.path: leaf value}; a dict value is a section, not a leaf."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat
