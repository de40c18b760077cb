# Two commands do all the setup: `make demo` and `make test`.
# Targets: install, test, test-slow, lint, format, docs, demo, demo-quick, clean; baseline (the quality
# benchmark's extras, The Well's baselines' packages and py-pde, into the same venv, torch pinned);
# pretrain (all nine built-in systems, about 30 minutes on 2 cores, model card beside the checkpoint;
# PRETRAIN_SIZE=small: three small systems, about 5 minutes).
# benchmark-quality: the whole quality protocol (docs/quality_protocol.md), hours (about two days
# on one core); never part of `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install baseline benchmark-quality test test-slow lint format docs demo demo-quick demo-dir pretrain clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned: a bare install pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]' torch==2.13.0
	# Test-only reference for walrus.metrics; --no-deps because it pins fsspec, and what its
	# metrics import (torch, numpy, h5py, pyyaml, einops, fsspec, matplotlib) is installed above.
	$(PY) -m pip install -q --no-deps the-well==1.2.0
	touch $(STAMP)

install: $(STAMP)

# The Well's FNO and UNetConvNext baselines and py-pde for benchmarks/quality.py; their tests
# run where this ran (WALRUS_REQUIRE_BASELINE=1 makes a missing one a test failure, not a skip).
# timm (The Well's models take DropPath from it) --no-deps: its torchvision requirement would
# bring a CUDA build that does not load against the CPU torch; DropPath needs only torch.
baseline: install
	$(PY) -m pip install -q -e '.[baseline]' torch==2.13.0
	$(PY) -m pip install -q --no-deps timm==1.0.31

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The default suite runs on every core (pytest-xdist); `-p no:xdist` runs it in one process.
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n auto

# Every test, the heavier ones too (the full quickstart accuracy run, distributed, compile).
test-slow: install
	$(PY) -m pytest -q -m ''

# The quality protocol (docs/quality_protocol.md), every cell one at a time as a new version in
# benchmarks/results/quality_v<N>/: HOURS (about two days on one core). Needs a committed tree;
# a stopped run resumes at the same commit. QUALITY_ARGS adds options (--dry-run, --data-root).
# Render it afterwards with `python -m benchmarks.quality_table --write`.
QUALITY_ARGS ?=
benchmark-quality: baseline
	$(PY) -m benchmarks.quality_protocol $(QUALITY_ARGS)

# The documentation site, built strictly (a broken link or docstring fails) into site/.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]' torch==2.13.0
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Demo: data -> train experiment=quickstart -> roll out on the test split. Knobs for a quick
# plumbing check: DEMO_DATA_ARGS (generator flags), DEMO_ARGS (train overrides),
# DEMO_INFER_ARGS (infer overrides), DEMO_DATA, DEMO_DIR.
DEMO_DATA ?= data
DEMO_DIR ?= outputs/demo
DEMO_DATA_ARGS ?=
DEMO_ARGS ?=
DEMO_INFER_ARGS ?=
# left in each folder `make demo` creates: it only ever deletes a folder holding this file
DEMO_MARKER := .made-by-make-demo

# A fresh, empty DEMO_DIR; a folder that `make demo` did not create is left alone.
DEMO_DIR_FOR ?= demo
DEMO_DIR_VAR ?= DEMO_DIR
demo-dir:
	@if [ -e "$(DEMO_DIR)" ] && [ ! -f "$(DEMO_DIR)/$(DEMO_MARKER)" ]; then \
		echo "make $(DEMO_DIR_FOR): $(DEMO_DIR) exists and was not created by make $(DEMO_DIR_FOR); not deleting it (move it, or set $(DEMO_DIR_VAR)=another/folder)"; \
		exit 1; \
	fi
	@rm -rf "$(DEMO_DIR)"
	@mkdir -p "$(DEMO_DIR)"
	@touch "$(DEMO_DIR)/$(DEMO_MARKER)"

demo: install
	test -d $(DEMO_DATA)/navier_stokes_2d/data || \
		$(PY) -m walrus.data.synthetic navier_stokes_2d --out $(DEMO_DATA) $(DEMO_DATA_ARGS)
	$(MAKE) --no-print-directory demo-dir DEMO_DIR="$(DEMO_DIR)"
	$(PY) train.py experiment=quickstart paths.data_dir=$(DEMO_DATA) \
		hydra.run.dir=$(DEMO_DIR) $(DEMO_ARGS)
	$(PY) infer.py rollout ckpt_path=$(DEMO_DIR)/checkpoints/last.ckpt split=test \
		out=$(DEMO_DIR)/rollout overwrite=true $(DEMO_INFER_ARGS)
	@echo "demo done: plots and metrics in $(DEMO_DIR)/rollout" \
		"(metrics.json, vrmse.png, snapshots.png, rollout.gif or .mp4, predictions.hdf5)"

# The demo in at most 3 minutes on 2 cores: 12 training trajectories instead of 24 and 300
# steps instead of 600, chosen on validation rollouts (beats persistence in every window;
# benchmarks/studies/demo_quick_sweep.py, benchmarks/results/demo_quick_sweep.json). Its own
# data and run folders; DEMO_DATA_ARGS, DEMO_ARGS and DEMO_INFER_ARGS add to its settings.
DEMO_QUICK_DATA ?= $(DEMO_DATA)/demo-quick
DEMO_QUICK_DIR ?= outputs/demo-quick
DEMO_QUICK_DATA_ARGS := --n-traj 12,4,4
DEMO_QUICK_ARGS := trainer.max_steps=300 trainer.max_epochs=-1

demo-quick:
	$(MAKE) --no-print-directory demo DEMO_DATA="$(DEMO_QUICK_DATA)" DEMO_DIR="$(DEMO_QUICK_DIR)" \
		DEMO_DATA_ARGS="$(DEMO_QUICK_DATA_ARGS) $(DEMO_DATA_ARGS)" \
		DEMO_ARGS="$(DEMO_QUICK_ARGS) $(DEMO_ARGS)" DEMO_INFER_ARGS="$(DEMO_INFER_ARGS)"

# Pretraining: experiment=pretrain on all nine built-in systems (missing data is generated first;
# trainer.max_time 00:00:25:00), then MODEL_CARD.md and model_card.json beside the checkpoint.
# PRETRAIN_SIZE=small runs experiment=pretrain_small instead (three systems of fewer, shorter
# trajectories, 3 minutes of training) with its own data and run folders.
# Knobs: PRETRAIN_DATA, PRETRAIN_DIR (same rule as DEMO_DIR: only a folder `make pretrain` made
# is replaced), PRETRAIN_ARGS (train overrides, e.g. trainer.max_time=00:00:10:00),
# PRETRAIN_CARD_ARGS (model card flags, bounded so that the card takes about a minute; --steps 0
# rolls out to the end, --tie-tolerance sets when the model ties persistence).
PRETRAIN_SIZE ?= full
ifeq ($(PRETRAIN_SIZE),small)
PRETRAIN_EXPERIMENT := pretrain_small
PRETRAIN_DATA ?= $(DEMO_DATA)/pretrain_small
PRETRAIN_DIR ?= outputs/pretrain_small
else ifeq ($(PRETRAIN_SIZE),full)
PRETRAIN_EXPERIMENT := pretrain
PRETRAIN_DATA ?= $(DEMO_DATA)
PRETRAIN_DIR ?= outputs/pretrain
else
$(error PRETRAIN_SIZE must be full or small, got '$(PRETRAIN_SIZE)')
endif
PRETRAIN_ARGS ?=
PRETRAIN_CARD_ARGS ?= --max-windows 8 --steps 10 --max-trajectories 2

pretrain: install
	@$(MAKE) --no-print-directory demo-dir DEMO_DIR="$(PRETRAIN_DIR)" DEMO_DIR_FOR=pretrain \
		DEMO_DIR_VAR=PRETRAIN_DIR
	$(PY) train.py experiment=$(PRETRAIN_EXPERIMENT) paths.data_dir=$(PRETRAIN_DATA) \
		hydra.run.dir=$(PRETRAIN_DIR) $(PRETRAIN_ARGS)
	$(PY) -m walrus.training.model_card $(PRETRAIN_DIR) $(PRETRAIN_CARD_ARGS)
	@echo "pretrain done: $(PRETRAIN_DIR)/checkpoints/last.ckpt, model card $(PRETRAIN_DIR)/MODEL_CARD.md"

clean:
	rm -rf $(VENV) outputs site .pytest_cache .ruff_cache
