"""Rewards added from outside the core: a recipe's (the procedural GenEval verifier) or a user's package's.

The core never imports such a reward. Its module registers it when imported::

    from omni_core.rewards.plugins import register_reward

    register_reward("my_reward", my_reward, owner=__name__)  # fn(image, ground_truth) -> float | {"score", ...}

and its package names that module under the `omni_core.rewards` entry-point group (pyproject.toml)::

    [project.entry-points."omni_core.rewards"]
    my_reward = "my_package.my_rewards"

so that the name resolves in any process on first use (`find_reward`): a Ray rollout worker that scores with it
imports the module there, the same way the flow process does. A config names it as it names a built-in (an entry
`{name: my_reward}`, or a prompt file's `data_source`). Light (no torch): validation reads the names from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

__all__ = ["ENTRY_POINT_GROUP", "AddedReward", "added_reward_names", "declared_rewards", "find_reward", "register_reward"]

ENTRY_POINT_GROUP = "omni_core.rewards"


@dataclass(frozen=True)
class AddedReward:
    """A registered reward: the function (`fn(image, ground_truth)`, as a built-in) and the module that added it."""

    fn: Callable[[Any, Any], Any]
    owner: str


_ADDED: dict[str, AddedReward] = {}


def register_reward(name: str, fn: Callable[[Any, Any], Any], *, owner: str) -> Callable[[Any, Any], Any]:
    """Add the reward `name` (`owner`: the registering module, shown in errors); returns `fn`.

    A built-in name, or a name another function holds, is refused: a config must mean one reward in every process.
    """
    from omni_core.rewards.names import BUILTIN_REWARD_NAMES, DATA_SOURCE_REWARDS, MODEL_REWARD_NAMES, PACKAGED_REWARD_NAMES

    if name in (*BUILTIN_REWARD_NAMES, *MODEL_REWARD_NAMES, *PACKAGED_REWARD_NAMES, *DATA_SOURCE_REWARDS):
        raise ValueError(f"reward {name!r} is one of OmniFlow's own; register it under another name")
    held = _ADDED.get(name)
    if held is not None and held.fn is not fn:
        raise ValueError(f"reward {name!r} is already registered by {held.owner}")
    _ADDED[name] = AddedReward(fn=fn, owner=owner)
    return fn


def declared_rewards() -> dict[str, str]:
    """Reward name -> module, from the installed packages' `omni_core.rewards` entry points (nothing is imported)."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def added_reward_names() -> dict[str, str]:
    """Every added reward this process can resolve, name -> where it comes from (registered or declared)."""
    return {**declared_rewards(), **{name: added.owner for name, added in _ADDED.items()}}


def find_reward(name: str) -> Callable[[Any, Any], Any] | None:
    """The added reward `name`, importing the module that declares it on first use; None when nothing adds it.

    Raises ValueError when the declaring module imports but does not register the name (a packaging mistake).
    """
    if name not in _ADDED:
        module = declared_rewards().get(name)
        if module is None:
            return None
        for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
            ep.load()  # importing the module registers its rewards
        if name not in _ADDED:
            raise ValueError(
                f"reward {name!r} is declared by {module} (entry point group {ENTRY_POINT_GROUP!r}), but importing it "
                f"registered no reward of that name; it must call register_reward({name!r}, fn, owner=__name__)"
            )
    return _ADDED[name].fn
