"""Load a user's reward function from a Python file (``reward.custom_reward_function.{path, name}``).

The function follows verl-omni's contract::

    def compute_score(data_source, solution_image, ground_truth, extra_info) -> float | dict

``solution_image`` is one sample's uint8 pixels (a CHW torch tensor when the batch is a tensor);
a dict return must hold ``"score"``, its other keys are kept as per-sample extras. Loading errors
are raised here, once, with the file path in the message; errors while scoring are per-sample
failures handled by :class:`omni_core.rewards.manager.RewardManager`.

`check_reward_source` is what `omniflow validate` runs: it parses the file without executing it (importing
would run the user's code, and often load a reward model, at validation time), so it catches a syntax
error, a missing or async function and a top-level import of a package that is not installed; an error
raised by the module's own top-level code still shows when the rollout worker loads it, with the file named.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_FUNCTION_NAME", "RewardLoadError", "check_reward_source", "load_reward_function"]

DEFAULT_FUNCTION_NAME = "compute_score"


class RewardLoadError(ValueError):
    """A custom reward file or function could not be loaded; the message names the file."""


def load_reward_function(path: str | Path, name: str | None = DEFAULT_FUNCTION_NAME) -> Callable[..., Any]:
    """Import ``path`` as a fresh module and return its callable ``name``.

    Raises:
        RewardLoadError: the file is missing, fails to import (syntax error, failing import, ...),
            has no attribute ``name`` (the message lists the callables it does define), the
            attribute is not callable, or it is an ``async def`` (not supported).
    """
    name = name or DEFAULT_FUNCTION_NAME
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise RewardLoadError(f"reward file {file} does not exist (reward.custom_reward_function.path={path})")

    # A unique module name per file, so two reward files that share a basename do not collide.
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    module_name = f"omni_custom_reward_{file.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"cannot import reward file {file}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    # Registered while executing, because dataclasses and typing look the module up by name;
    # removed afterwards so cloudpickle ships the function by value to Ray workers, which could
    # not import this synthetic module name.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        raise RewardLoadError(f"syntax error in reward file {file}, line {err.lineno}: {err.msg}") from err
    except Exception as err:
        raise RewardLoadError(f"importing reward file {file} failed: {type(err).__name__}: {err}") from err
    finally:
        sys.modules.pop(module_name, None)

    if not hasattr(module, name):
        found = sorted(
            attr
            for attr, value in vars(module).items()
            if callable(value) and not attr.startswith("_") and getattr(value, "__module__", None) == module_name
        )
        raise RewardLoadError(
            f"reward file {file} has no function {name!r} (reward.custom_reward_function.name); "
            f"callables defined there: {found or 'none'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardLoadError(f"{name!r} in reward file {file} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn):
        raise RewardLoadError(f"{name!r} in reward file {file} is async; OmniFlow calls rewards synchronously")
    return fn


def check_reward_source(path: str | Path, name: str | None = DEFAULT_FUNCTION_NAME) -> None:
    """Check a reward file without executing it: it parses, defines ``name`` at top level (not ``async``), and
    each module-level ``import`` outside a ``try`` names an installed package (found, not imported).

    Raises:
        RewardLoadError: the message names the file, the line and the fix.
    """
    name = name or DEFAULT_FUNCTION_NAME
    file = Path(path).expanduser().resolve()
    try:
        source = file.read_bytes().decode("utf-8")
        tree = ast.parse(source, filename=str(file))
    except OSError as err:
        raise RewardLoadError(f"cannot read reward file {file}: {err}") from err
    except UnicodeDecodeError as err:
        raise RewardLoadError(f"reward file {file} is not UTF-8 text (offset {err.start}); save it as UTF-8") from err
    except SyntaxError as err:
        raise RewardLoadError(f"syntax error in reward file {file}, line {err.lineno}: {err.msg}") from err

    defined: dict[str, ast.stmt] = {}
    dynamic = False  # `from x import *` or anything else that may define names we cannot see
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(alias.name == "*" for alias in node.names):
                dynamic = True
            defined.update({(alias.asname or alias.name).split(".")[0]: node for alias in node.names})
            _check_installed(node, file)
        else:
            dynamic = dynamic or isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While)
    if name not in defined and not dynamic:
        functions = sorted(n for n, node in defined.items() if isinstance(node, ast.FunctionDef) and not n.startswith("_"))
        raise RewardLoadError(
            f"reward file {file} has no function {name!r} (reward.custom_reward_function.name, or the entry's "
            f"function); functions defined there: {functions or 'none'}"
        )
    if isinstance(defined.get(name), ast.AsyncFunctionDef):
        raise RewardLoadError(f"{name!r} in reward file {file} is async; OmniFlow calls rewards synchronously")


def _check_installed(node: ast.Import | ast.ImportFrom, file: Path) -> None:
    """A module-level absolute import whose top-level package this interpreter cannot find (not imported)."""
    if isinstance(node, ast.ImportFrom):
        if node.level or not node.module:
            return  # relative: resolved against a package the file is not part of at runtime either
        modules = [node.module]
    else:
        modules = [alias.name for alias in node.names]
    for module in modules:
        top = module.split(".")[0]
        if top in sys.modules or top in sys.builtin_module_names:
            continue
        if importlib.util.find_spec(top) is None:
            raise RewardLoadError(
                f"reward file {file}, line {node.lineno}: imports {module!r}, but no package {top!r} is installed in "
                f"this environment ({sys.executable}); install it where the run executes, or guard the import with "
                "try/except inside the file"
            )
