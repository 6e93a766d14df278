# zero-course: `make train` runs the main job, `make test` runs everything CI runs, `make lab` opens the course.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed's just-in-time ops, built once per environment (labs.env.extensions_dir uses the same folder)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

# Knobs for `make train` (GPU host defaults differ; see README).
GPU := $(shell [ -x $(PY) ] && $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
PRESET ?= $(if $(filter 1,$(GPU)),qwen2.5-7b,tiny)
CONFIG ?= zero3.json
STEPS ?= $(if $(filter 1,$(GPU)),20,30)
NPROC ?=
OUT ?= runs/train
LOSS ?= $(if $(filter 1,$(GPU)),liger,hf)
KERNELS ?= $(if $(filter 1,$(GPU)),liger,stock)
CHECKPOINTING ?= $(if $(filter 1,$(GPU)),full,none)

.PHONY: train test unit notebooks book browser lab execute clean

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/labs train --preset $(PRESET) --config $(CONFIG) --steps $(STEPS) --out $(OUT) \
	  --loss $(LOSS) --kernels $(KERNELS) --activation-checkpointing $(CHECKPOINTING) $(if $(NPROC),--nproc $(NPROC))

# One cache of finished runs for the unit tests and the notebooks of this `make test` (labs/runcache.py): a run the
# tests launched is not trained again when a chapter asks for the very same run. Removed when the target ends.
# The launch report at the end says how many runs were trained or reused and which took longest (tools/).
test: $(STAMP)
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	  { LABS_RUN_CACHE=$$cache $(MAKE) --no-print-directory unit notebooks; code=$$?; \
	    $(PY) tools/launch_report.py "$$cache"; exit $$code; }
	$(MAKE) --no-print-directory book browser

unit: $(STAMP)
	$(PY) -m pytest tests -q --ignore=tests/browser --durations=15 --instafail

notebooks: $(STAMP)
	$(PY) -m pytest --nbval-lax notebooks -q -p no:cacheprovider --durations=15 --instafail

book: $(STAMP)
	rm -rf book/_build
	$(VENV)/bin/jupyter-book build -W --keep-going book/

browser: book   # the built book and JupyterLab in headless Chromium (/usr/bin/chromium); skips, saying why, without one
	$(PY) -m pytest tests/browser -q --instafail

execute: $(STAMP)   # re-run chapters in place (NOTEBOOKS="notebooks/01_memory_math.ipynb ..." for some)
	$(PY) tools/execute_notebooks.py $(NOTEBOOKS)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --notebook-dir=. $(if $(filter 0,$(shell id -u)),--allow-root)

clean:
	rm -rf runs book/_build
