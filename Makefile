# OmniFlow set-up and entry points. `make run` and `make test` each install what is missing first.
PYTHON ?= python3
STAMP := .install-stamp
MODEL ?= models/tiny-sd3

.PHONY: install run test test-light test-bench lint clean

# torch: keep any installed build (CUDA users bring their own); otherwise the CPU build 2.13.0,
# because an unpinned torch from PyPI pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# The main job: build the tiny SD3-family model if absent, then fine-tune it with Flow-GRPO
# (jpeg_compressibility reward) as the Prefect flow main_diffusion_v1 on a local Ray cluster.
# Every SDE step but the last is trained (window null): learning a newcomer can see (docs/running.md, "The main job");
# the library defaults keep Flow-GRPO-Fast's window of 2 for speed. Validation runs before training and after the
# last step (test_freq=24, the run's steps), so the summary shows the validation reward before and after.
RUN_OVERRIDES ?= actor_rollout_ref.rollout.algo.sde_window_size=null actor_rollout_ref.rollout.algo.sde_window_range=null trainer.test_freq=24
run: install
	@[ -f $(MODEL)/model_index.json ] || $(PYTHON) -m omniflow.flows.cli make-tiny-model $(MODEL)
	$(PYTHON) -m omniflow.flows.cli train actor_rollout_ref.model.path=$(MODEL) $(RUN_OVERRIDES)

# The suite, without the tests of benchmark scripts (marker `bench`, run by test-bench; CI runs both), in two
# pytest-xdist processes: a flow-heavy test leaves about a third of 2 cores idle (waiting on servers and processes),
# which the other process uses. A module's tests share one process (tests/conftest.py). pytest's exit 5 (nothing
# collected) fails either target.
test: install
	$(PYTHON) -m pytest -m "not bench" -n 2 --dist loadgroup

# The tests that start no Ray cluster, Prefect server or subprocess (marker `light`, tests/conftest.py): a few
# minutes alone, for a quick check while working.
test-light: install
	$(PYTHON) -m pytest -m "light and not bench"

test-bench: install
	$(PYTHON) -m pytest -m bench

lint: install
	$(PYTHON) -m ruff check .

clean:
	rm -rf $(STAMP) outputs .pytest_cache
