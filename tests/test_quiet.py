"""`omni_core.quiet`: the library notices that call for no action are dropped, and nothing else of those loggers."""

from __future__ import annotations

import logging

from omni_core.quiet import drop_library_notices


def test_a_none_component_that_cannot_be_saved_is_dropped_and_another_type_still_warns(caplog):
    drop_library_notices()
    log = logging.getLogger("diffusers.pipelines.pipeline_utils")
    with caplog.at_level(logging.WARNING, logger="diffusers.pipelines.pipeline_utils"):
        log.warning("self.vae=None of type <class 'NoneType'> cannot be saved.")
        log.warning("self.unet=<Foo> of type <class 'Foo'> cannot be saved.")
    assert [r.getMessage() for r in caplog.records] == ["self.unet=<Foo> of type <class 'Foo'> cannot be saved."]
