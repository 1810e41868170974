"""The install: a distribution name of our own, upper bounds on the 0.x dependencies, and constraints.txt pinning
every dependency within pyproject's bounds (what `make` installs with)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from omni_core.cache_keys import DISTRIBUTION

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements() -> list[Requirement]:
    project = _pyproject()["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return [Requirement(r) for r in [*project["dependencies"], *extras]]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_the_distribution_is_not_the_other_projects_omniflow_and_keeps_the_command():
    project = _pyproject()["project"]
    assert project["name"] == DISTRIBUTION and canonicalize_name(DISTRIBUTION) != "omniflow"
    assert project["scripts"] == {"omniflow": "omniflow.flows.cli:main"}


def test_every_dependency_is_pinned_in_the_constraints_within_its_bounds_but_torch():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name in ("torch", canonicalize_name(DISTRIBUTION)):
            assert name not in pins, f"{name} must not be pinned (an installed torch is kept)"
            continue
        assert name in pins, f"{req.name} is not in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is outside {req.specifier}"


def test_zero_x_dependencies_have_an_upper_bound():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if pins.get(name, "1").startswith("0."):
            assert any(spec.operator in ("<", "<=", "~=", "==") for spec in req.specifier), f"{req} has no upper bound"
