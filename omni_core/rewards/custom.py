"""Load a user's reward function from a Python file (``reward.custom_reward_function.{path, name}``).

The function follows verl-omni's contract::

    def compute_score(data_source, solution_image, ground_truth, extra_info) -> float | dict

``solution_image`` is one sample's uint8 pixels (a CHW torch tensor when the batch is a tensor);
a dict return must hold ``"score"``, its other keys are kept as per-sample extras. Loading errors
are raised here, once, with the file path in the message; errors while scoring are per-sample
failures handled by :class:`omni_core.rewards.manager.RewardManager`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_FUNCTION_NAME", "RewardLoadError", "load_reward_function"]

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
