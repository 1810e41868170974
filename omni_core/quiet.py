"""Library output that calls for no action, turned off where OmniFlow starts Ray and loads and saves models.

A run loads the pipeline in every actor, so each notice below would print once per process:

- transformers' notice that `CLIPImageProcessor` / `SiglipImageProcessor` fall back to PIL without
  torchvision (diffusers' IP-adapter loader imports those classes; OmniFlow never uses them);
- diffusers' and transformers' progress bars while loading and saving a pipeline;
- diffusers' "Attention backends are an experimental feature" on every `set_attention_backend`;
- Ray's notice that it turned token authentication on for a local cluster (its default since 2.60;
  the token stays on).
- mlflow's notices that it creates / updates the tables of its SQLite store (the `mlflow` tracker's local
  store, at the first epoch of a run).
- diffusers' notice, when a pipeline is saved, that a component which is None (e.g. the procedural recipe's
  pixel-space model has no VAE) "cannot be saved": there is nothing to save; a component of another type still warns.

Only these exact messages are dropped: every other warning of these libraries still shows.

wandb is the exception: it prints to stderr itself, not through `logging`, three banner lines per epoch (offline
mode, where the run is saved, `wandb leet`). Its run starts with `wandb.Settings(silent=True)`
(`omni_core/trackers/wandb_run.py`), which sends all its terminal output, warnings included, to the run's own
debug log; the tracker says where the run is in one console line instead, and wandb's errors still raise.
"""

from __future__ import annotations

import logging

# logger name -> message fragments dropped from it
_DROPPED: dict[str, tuple[str, ...]] = {
    "transformers.utils.import_utils": ("requires torchvision",),
    "diffusers.models.modeling_utils": ("Attention backends are an experimental feature",),
    "ray._private.authentication.authentication_token_setup": ("Token authentication is enabled for this Ray cluster",),
    "mlflow.store.db.utils": ("Creating initial MLflow database tables", "Updating database tables"),
    "diffusers.pipelines.pipeline_utils": ("=None of type <class 'NoneType'> cannot be saved",),
}


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def drop_library_notices() -> None:
    """Install the message filters; call before diffusers is imported (imports nothing). Idempotent."""
    for name, fragments in _DROPPED.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in log.filters):
            log.addFilter(_DropMessages(fragments))


def quiet_model_libraries() -> None:
    """The message filters, and diffusers' / transformers' progress bars off (imports both). Idempotent."""
    drop_library_notices()
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
