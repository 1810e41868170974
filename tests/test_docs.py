"""The documentation: a README that stands alone and stays short, links that lead somewhere, no path outside the
repository, the set-up commands where a reader (and a checker) looks first, and a DAG table that lists the tasks
the flow really calls, in its order. Light: reads files only.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 300
# Pages whose links and wording are checked: the README, docs/ and the benchmarks' own pages.
PAGES = [
    README,
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
    ROOT / "benchmarks" / "results" / "HISTORY.md",
]
# Names of things outside the repository (developer notes, scripts of the machine it was built on).
OUTSIDE = (
    "../shared",
    "shared/scripts",
    "fresh-clone-check",
    "DESIGN.md",
    "STYLE.md",
    "reference/diffusion-rl.md",
    "reference/verl-omni.md",
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _repository_files() -> list[Path]:
    """The repository's files: everything under its root but `.git` and what `.gitignore` leaves out (its patterns
    are names, matched against each path part, or `/`-anchored names, matched at the root only)."""
    lines = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines() if line.strip() and line[0] != "#"]
    anywhere = [line.rstrip("/") for line in lines if not line.startswith("/")]
    at_root = [line.strip("/") for line in lines if line.startswith("/")]

    def ignored(folder: str, name: str) -> bool:
        names = anywhere + (at_root if Path(folder) == ROOT else [])
        return name == ".git" or any(fnmatch.fnmatch(name, pattern) for pattern in names)

    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not ignored(folder, d)]
        found += [Path(folder) / name for name in files if not ignored(folder, name)]
    return found


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (a link inside a code block is not a link)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation other than `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in _prose(page.read_text()).splitlines() if re.match(r"#{1,6} ", line)}


def _code_block_lines(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif fenced:
            lines.append(line.strip())
    return lines


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/"
    )


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... not a file of the repository
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not file.is_relative_to(ROOT):
                broken.append(f"{where} (outside the repository)")
            elif not file.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in _anchors(file):
                broken.append(f"{where} (no such heading in {file.relative_to(ROOT)})")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_nothing_in_the_repository_names_a_path_outside_it():
    found = []
    for path in sorted(set(_repository_files()) - {Path(__file__).resolve()}):
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a binary file: nothing a reader follows
            continue
        found += [f"{path.relative_to(ROOT)}: {name}" for name in OUTSIDE if name in text]
    assert not found, "names of paths outside the repository:\n  " + "\n  ".join(found)


def test_the_readme_shows_make_run_then_make_test_first():
    # A reader, and the checker that parses the README, take the first `make` line of a code block without "test"
    # as the main job's command and the first with "test" as the suite's.
    makes = [line for line in _code_block_lines(README.read_text()) if re.fullmatch(r"make [\w-]+", line)]
    assert next(line for line in makes if "test" not in line) == "make run", makes
    assert next(line for line in makes if "test" in line) == "make test", makes
    assert "make test-light" in makes, makes


def _decorated(tree: ast.AST, decorator: str) -> set[str]:
    """Names of the functions in `tree` decorated with `decorator` or `decorator(...)`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if isinstance(target, ast.Name) and target.id == decorator:
                    names.add(node.name)
    return names


def _flow_stages() -> list[str]:
    """The tasks and subflows `main_diffusion_v1` calls (`x(...)` or `x.submit(...)`), in the order of its source."""
    tasks = set()
    for path in sorted((ROOT / "tasks").glob("*.py")):
        tasks |= _decorated(ast.parse(path.read_text()), "task")
    tree = ast.parse((ROOT / "flows" / "main_diffusion_v1.py").read_text())
    stages = tasks | _decorated(tree, "flow")
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "main_diffusion_v1")
    calls = sorted((n for n in ast.walk(body) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    order: list[str] = []
    for call in calls:
        func = call.func.value if isinstance(call.func, ast.Attribute) and call.func.attr == "submit" else call.func
        if isinstance(func, ast.Name) and func.id in stages and func.id not in order:
            order.append(func.id)
    return order


def _readme_dag_stages() -> list[str]:
    """The task column of the README's DAG table: the first `name` of each row's second cell."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## How a run is built"))
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, _rule, *body = rows
    assert header[1] == "Prefect task", header
    return [re.search(r"`([^`]+)`", row[1]).group(1) for row in body]


def test_the_readme_dag_lists_the_flows_tasks_in_order():
    stages = _flow_stages()
    assert stages[0] == "validate_config" and "fit" in stages and stages[-1] == "close_transfer_queue", stages
    assert _readme_dag_stages() == stages
