"""`PolicyGradientDiffusionTrainerV1`: the base trainer and its named hooks (verl-omni's `trainer_base.py`).

A trainer mode is hooks only: subclasses registered with `@register_diffusion_trainer(name)`
override `on_*` methods. The training loop itself arrives with the main-job issue (#4); until then
`init` and `fit` refuse to run rather than pretend to train.
"""

from __future__ import annotations

from omni_core.config import OmniFlowConfig

_NOT_YET = (
    "the v1 training loop is not implemented yet in this version of OmniFlow (it arrives with the "
    "main-job issue); `omniflow validate` checks a config without training"
)


class PolicyGradientDiffusionTrainerV1:
    """Base v1 trainer: `init()` -> `_setup()` + `on_init_end()`, then `fit(agent_loop_manager)`."""

    mode: str = "base"

    def __init__(self, config: OmniFlowConfig):
        self.config = config

    # The lifecycle verl-omni users know.
    def init(self) -> None:
        raise NotImplementedError(_NOT_YET)

    def fit(self, agent_loop_manager: object) -> None:
        raise NotImplementedError(_NOT_YET)

    # Hooks: a mode overrides what it needs.
    def on_init_end(self) -> None: ...
    def on_train_begin(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_validate_begin(self) -> None: ...
    def on_validate_end(self) -> None: ...
    def on_step_begin(self) -> None: ...
    def on_step_end(self) -> None: ...
    def on_sample_begin(self) -> None: ...
    def on_sample_end(self) -> None: ...
