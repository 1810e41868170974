# OmniFlow set-up and entry points. `make run` and `make test` each install what is missing first, quietly, into the
# project's own virtual environment .venv (the installer's output goes to .venv/install.log).
BASE_PYTHON ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.install-stamp
MODEL ?= models/tiny-sd3
# The environment's commands (omniflow, prefect, ray) come first for the commands below and what they start.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export VIRTUAL_ENV := $(CURDIR)/$(VENV)

.PHONY: install run test test-light test-bench lint clean

# The venv sees the interpreter's own packages (--system-site-packages) so that an installed torch is kept (CUDA
# users bring their own build); without one, the CPU build torch==2.13.0, because an unpinned torch from PyPI pulls
# a multi-GB CUDA build. Everything else installs into .venv at the versions of constraints.txt.
$(PYTHON):
	@$(BASE_PYTHON) -m venv --system-site-packages $(VENV) || { echo "omniflow: '$(BASE_PYTHON) -m venv' failed; on Debian/Ubuntu: apt install python3-venv"; exit 1; }

$(STAMP): pyproject.toml constraints.txt | $(PYTHON)
	@echo "omniflow: installing into $(VENV) (the first time takes a few minutes; log: $(VENV)/install.log)"
	@{ $(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"; \
	   $(PYTHON) -m pip install -c constraints.txt -e ".[dev]"; } > $(VENV)/install.log 2>&1 \
	  || { tail -n 25 $(VENV)/install.log; echo "omniflow: the install failed; the whole log: $(VENV)/install.log"; exit 1; }
	@rm -rf omniflow_rl.egg-info
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
	rm -rf $(VENV) outputs .pytest_cache
