"""What a newcomer's console shows: step lines with units, elapsed time and ETA; the run summary's validation before
and after training, labelled; where to browse a finished run."""

from __future__ import annotations

import io
import time

from omni_core.records import EpochResult, RunInfo
from omni_core.tracking import Tracking, format_duration


def test_durations_read_as_a_person_writes_them():
    assert [format_duration(s) for s in (0, 42.4, 185, 7620, 90061)] == ["0s", "42s", "3m05s", "2h07m", "25h01m"]


def test_a_step_line_has_units_the_time_since_the_start_and_an_eta_from_the_last_steps(tmp_path):
    out = io.StringIO()
    tracking = Tracking(["console"], tmp_path, total_steps=10, stream=out, started_at=time.time() - 125)
    tracking.log({"critic/rewards/mean": 0.5, "timing_s/step": 4.0}, step=1)
    tracking.log({"critic/rewards/mean": 0.6, "timing_s/step": 6.0}, step=2)
    tracking.log({"val-core/tiny/reward/mean@2": 0.7}, step=10)
    first, second, last = out.getvalue().splitlines()
    assert "step_time=4.0s" in first and "ETA 36s" in first  # 9 steps left at 4 s
    assert "step_time=5.0s" not in second and "step_time=6.0s" in second
    assert "ETA 40s" in second  # 8 steps left at the mean of 4 s and 6 s
    assert "elapsed 2m05s" in first
    assert "ETA" not in last and "val-core/tiny/reward/mean@2=0.7" in last  # the last step: nothing left
    tracking.close()


def test_the_summary_labels_validation_before_training_and_after_the_last_step():
    from omniflow.flows.main_diffusion_v1 import summarize
    from omniflow.flows.train_cli import validation_lines

    run = RunInfo("r", "omniflow", "/ckpt", "/ckpt/logs/r")
    before, after = {"val-core/tiny/reward/mean@2": 0.25}, {"val-core/tiny/reward/mean@2": 0.75}
    epochs = [
        EpochResult(0, 2, "/ckpt/global_step_2", [{"critic/rewards/mean": 0.1}] * 2, before, [(0, "/g0.png", before)]),
        EpochResult(1, 4, "/ckpt/global_step_4", [{"critic/rewards/mean": 0.2}] * 2, {}, [(4, "/g4.png", after)]),
    ]
    result = summarize(run, epochs)
    assert (result.val_before_train, result.val_metrics, result.val_step) == (before, after, 4)
    assert validation_lines(result) == [
        "validation before training: val-core/tiny/reward/mean@2 0.250000",
        "validation after step 4:  val-core/tiny/reward/mean@2 0.750000",
    ]
    only_before = summarize(run, epochs[:1])
    assert validation_lines(only_before)[1].startswith("no validation after training (set trainer.test_freq")


def test_a_finished_experiments_summary_says_so_and_shows_no_rewards_or_metrics_it_never_wrote(capsys):
    from omniflow.flows.main_diffusion_v1 import summarize
    from omniflow.flows.train_cli import _report

    from omni_core.reports.cards import already_complete_note

    result = summarize(RunInfo("r", "omniflow", "/ckpt", "/ckpt/logs/r"), [], "/ckpt/global_step_24", 24)
    result.note = already_complete_note("tiny", 24)
    _report(result)
    out = capsys.readouterr().out
    assert f"  nothing trained: {result.note}\n" in out and "(last: /ckpt/global_step_24)" in out
    for absent in ("mean reward", "nan", "metrics:", "/ckpt/logs/r", "omniflow-validation"):
        assert absent not in out, (absent, out)
