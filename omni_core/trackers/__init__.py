"""The external tracking services of `trainer.logger`: `wandb` (`wandb_run.py`) and `mlflow` (`mlflow_run.py`),
and the identity they share (`run.py`): one tracker run per checkpoint folder. `omni_core.tracking.Tracking` is
the one entry point; these modules import their service lazily, so neither is needed unless it is asked for."""
