"""`new_experiment_per_run`: a scheduled run trains its own experiment instead of resuming the last one."""

from __future__ import annotations

from pathlib import Path

from omni_core.config import load_config, with_experiment_suffix

STAMP = "20261203-030000-crimson-otter"


def test_new_experiment_gets_its_own_name_and_checkpoint_folder():
    cfg = load_config([], ["trainer.experiment_name=tiny-sd3-nightly"])
    out = with_experiment_suffix(cfg, STAMP)
    assert out.trainer.experiment_name == f"tiny-sd3-nightly-{STAMP}"
    assert out.trainer.checkpoint_dir == Path("checkpoints") / "omniflow" / f"tiny-sd3-nightly-{STAMP}"
    assert cfg.trainer.experiment_name == "tiny-sd3-nightly"  # the input config is unchanged (immutable)


def test_an_explicit_checkpoint_folder_gets_a_subfolder_per_run(tmp_path):
    cfg = load_config([], ["trainer.experiment_name=nightly", f"trainer.default_local_dir={tmp_path}"])
    out = with_experiment_suffix(cfg, STAMP)
    assert out.trainer.checkpoint_dir == tmp_path / f"nightly-{STAMP}"
