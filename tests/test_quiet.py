"""`omni_core.quiet`: the library notices that call for no action are dropped, and nothing else of those loggers."""

from __future__ import annotations

import logging

from omni_core.quiet import drop_library_notices


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_none_component_that_cannot_be_saved_is_dropped_and_another_type_still_warns():
    """A handler on the logger itself (diffusers stops its loggers' propagation once it is imported, so the root's
    capture may see nothing either way)."""
    drop_library_notices()
    log = logging.getLogger("diffusers.pipelines.pipeline_utils")
    kept = _Kept()
    log.addHandler(kept)
    try:
        log.warning("self.vae=None of type <class 'NoneType'> cannot be saved.")
        log.warning("self.unet=<Foo> of type <class 'Foo'> cannot be saved.")
    finally:
        log.removeHandler(kept)
    assert kept.messages == ["self.unet=<Foo> of type <class 'Foo'> cannot be saved."]
