"""Every `omniflow <word>` that the README, the docs, the defaults' comments or a message of the code tells a user to type is
a subcommand of the real `omniflow` parser (`flows/cli.py: build_parser`).

The rule for what counts as a command: `omniflow` written in lower case as a word of its own (not after a letter,
digit, `.`, `/` or `-`), then exactly one space, then a lower-case word (letters, digits, `-`): that word is the
command. It leaves out, without a list of exceptions, what is not a command: the product name in prose
(`OmniFlow`), the message prefix `omniflow:` (a colon, no space), names joined with a hyphen (`omniflow-gpu`,
`omniflow-alerts`), module paths (`omniflow.flows`) and image names (`REGISTRY/omniflow:cuda`). Where the command
has subcommands of its own (`omniflow config show`), the next word must be one of them.

Sources: README.md and docs/*.md (all of them), the comment lines of omni_core/config/defaults.yaml, and every string
literal (f-string parts included) of the Python files under omni_core/, flows/, tasks/ and deployments/. Light: reads
files only.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from omniflow.flows.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("omni_core", "flows", "tasks", "deployments")
COMMAND = re.compile(r"(?<![\w./-])omniflow (?P<command>[a-z][a-z0-9-]*)(?: (?P<sub>[a-z][a-z0-9-]*))?")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _texts() -> list[tuple[str, str]]:
    """(where, text) for every place a user reads: the README and the docs, the defaults' comments, the code's string
    literals."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = [(str(path.relative_to(ROOT)), path.read_text()) for path in docs]
    defaults = ROOT / "omni_core" / "config" / "defaults.yaml"
    for n, line in enumerate(defaults.read_text().splitlines(), 1):
        if line.lstrip().startswith("#"):
            texts.append((f"{defaults.relative_to(ROOT)}:{n}", line))
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    texts.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.value))
    return texts


def _mentions() -> list[tuple[str, str, str | None]]:
    return [(where, m["command"], m["sub"]) for where, text in _texts() for m in COMMAND.finditer(text)]


def test_every_omniflow_command_named_to_users_is_a_subcommand_of_the_parser():
    commands = _subcommands(build_parser())
    mentions = _mentions()
    # The scan sees the commands the issue named (README, docs and defaults.yaml) and the code's messages.
    named = {command for _, command, _ in mentions}
    assert {"export", "evaluate", "train", "validate", "serve"} <= named, sorted(named)
    assert any(where.startswith("omni_core/checkpoint/compat.py") and c == "export" for where, c, _ in mentions)

    missing = sorted({f"omniflow {command} ({where})" for where, command, _ in mentions if command not in commands})
    assert not missing, "named to users but not a subcommand of flows/cli.py:\n  " + "\n  ".join(missing)
    nested = [
        f"omniflow {command} {sub} ({where})"
        for where, command, sub in mentions
        if sub is not None and _subcommands(commands[command]) and sub not in _subcommands(commands[command])
    ]
    assert not nested, "not a subcommand of its command:\n  " + "\n  ".join(nested)


def test_the_rule_leaves_out_names_that_are_not_commands():
    text = (
        "omniflow: no block; prefect work-pool create omniflow-gpu; import omniflow.flows; REGISTRY/omniflow:cuda; "
        "OmniFlow trains; run `omniflow export CKPT OUT` or omniflow config show"
    )
    assert [(m["command"], m["sub"]) for m in COMMAND.finditer(text)] == [("export", None), ("config", "show")]
