"""Library output that calls for no action, turned off where OmniFlow starts Ray and loads and saves models.

A run loads the pipeline in every actor, so each notice below would print once per process:

- transformers' notice that `CLIPImageProcessor` / `SiglipImageProcessor` fall back to PIL without
  torchvision (diffusers' IP-adapter loader imports those classes; OmniFlow never uses them);
- diffusers' and transformers' progress bars while loading and saving a pipeline;
- diffusers' "Attention backends are an experimental feature" on every `set_attention_backend`;
- Ray's notice that it turned token authentication on for a local cluster (its default since 2.60;
  the token stays on).

Only these exact messages are dropped: every other warning of these libraries still shows.
"""

from __future__ import annotations

import logging

# logger name -> message fragments dropped from it
_DROPPED: dict[str, tuple[str, ...]] = {
    "transformers.utils.import_utils": ("requires torchvision",),
    "diffusers.models.modeling_utils": ("Attention backends are an experimental feature",),
    "ray._private.authentication.authentication_token_setup": ("Token authentication is enabled for this Ray cluster",),
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
