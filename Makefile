# zero-course: `make train` runs the main job, `make test` runs everything CI runs, `make lab` opens the course.
PYTHON ?= python3
# bash: the test streams use pipefail
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed's just-in-time ops, built once per environment (labs.env.extensions_dir uses the same folder)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
# Transparent huge pages for glibc malloc in every process make starts (pytest, the kernels, labs and its ranks): the
# kernel then zeroes fresh memory 2 MiB at a time, not in 4 KiB faults (labs/env.py gives CPU ranks the same setting;
# tests/test_train.py ran in 54 s instead of 69 on a 2-core VM). A no-op where THP is off or glibc is older than 2.35.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

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

.PHONY: train test tests-stream chapters-stream chapters-a chapters-b unit notebooks book browser lab execute clean

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

# `make test` runs three streams side by side on two cores, each line prefixed with what printed it: most unit tests
# then the late chapters; chapters 1-4 then the autotuner's and ZenFlow's tests; chapters 5-8 then the benchmark's tests. Two
# streams left a third of a core idle (a fresh clone on a 2-core VM, 2026-12-05: 20:35 in all, 1.64 cores busy): rank
# start-up, rendezvous and kernels waiting on their ranks leave gaps. Three streams with all unit tests in one took
# 20:19 (unit 17:37, chapters 1-4 12:32, chapters 5-8 13:37), so test files moved to the chapter streams: with the
# autotuner's and the benchmark's there, 18:19 (unit 16:02; chapters 1-4 and the autotuner 13:18; chapters 5-8 and the
# benchmark 14:01), then ZenFlow's tests too (about a minute of the unit stream's lead). DeepSpeed's CPU Adam op is
# built before the streams start: built on demand, it compiled beside three streams for 5.6 minutes while the tests
# and chapters that need it waited (a run of 23:13); alone it takes 54 s. The
# quickstart goes last in the unit stream: its one 30-step run is the one tests/test_train.py trains, so there it is
# copied from the run cache, where first in another stream it was trained (42 s). One cache of finished runs serves
# every stream (labs/runcache.py): a run the tests launched is not trained again when a chapter asks for the very same
# run; a chapter that asks while a test trains it waits for it. The chapters write their runs under the same temporary
# folder (LABS_RUNS), not into runs/, removed when the target ends. The launch report at the end says how many runs
# were trained or reused and which took longest (tools/).
LATE_CHAPTERS := notebooks/00_quickstart.ipynb notebooks/09_qwen7b_on_gpu.ipynb notebooks/10_zenflow.ipynb
EARLY_CHAPTERS := $(filter-out $(LATE_CHAPTERS),$(sort $(wildcard notebooks/*.ipynb)))
CHAPTERS_A := $(filter notebooks/01% notebooks/02% notebooks/03% notebooks/04%,$(EARLY_CHAPTERS))
CHAPTERS_B := $(filter-out $(CHAPTERS_A),$(EARLY_CHAPTERS))
TESTS_A := tests/test_autotune.py tests/test_zenflow.py
TESTS_B := tests/test_bench.py
test: $(STAMP)
	@echo "building DeepSpeed's CPU Adam op once, before the streams (about a minute on 2 cores; cached in $(TORCH_EXTENSIONS_DIR))"
	$(PY) -c "from labs import env; env.name_deepspeed_accelerator(); from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" > /dev/null
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	  { LABS_RUN_CACHE=$$cache LABS_RUNS=$$cache/runs $(MAKE) --no-print-directory -j3 tests-stream chapters-a chapters-b; \
	    code=$$?; $(PY) tools/launch_report.py "$$cache"; exit $$code; }
	$(MAKE) --no-print-directory book browser

# make's own -j3 starts the three streams: a shell's `&` would start them with SIGINT ignored, which the Ctrl-C tests
# (tests/test_run_control.py) would inherit
tests-stream: $(STAMP)
	set -o pipefail; $(PY) -m pytest tests -q --ignore=tests/browser $(foreach t,$(TESTS_A) $(TESTS_B),--ignore=$(t)) \
	  --durations=15 --instafail 2>&1 | sed -u 's/^/unit| /'; unit=$$?; \
	  $(MAKE) --no-print-directory notebooks NOTEBOOK_FILES="$(LATE_CHAPTERS)" 2>&1 | sed -u 's/^/chapters 0, 9, 10| /'; \
	  exit $$(( unit || $$? ))

chapters-stream: chapters-a chapters-b

chapters-a: $(STAMP)
	set -o pipefail; $(MAKE) --no-print-directory notebooks NOTEBOOK_FILES="$(CHAPTERS_A)" 2>&1 | \
	  sed -u 's/^/chapters 1-4| /'; nb=$$?; \
	  $(PY) -m pytest $(TESTS_A) -q --durations=5 --instafail 2>&1 | sed -u 's/^/unit, autotuner and ZenFlow| /'; exit $$(( nb || $$? ))

chapters-b: $(STAMP)
	set -o pipefail; $(MAKE) --no-print-directory notebooks NOTEBOOK_FILES="$(CHAPTERS_B)" 2>&1 | \
	  sed -u 's/^/chapters 5-8| /'; nb=$$?; \
	  $(PY) -m pytest $(TESTS_B) -q --durations=5 --instafail 2>&1 | sed -u 's/^/unit, bench| /'; exit $$(( nb || $$? ))

unit: $(STAMP)
	$(PY) -m pytest tests -q --ignore=tests/browser --durations=15 --instafail

notebooks: $(STAMP)
	$(PY) -m pytest --nbval-lax $(or $(NOTEBOOK_FILES),notebooks) -q -p no:cacheprovider --durations=15 --instafail

book: $(STAMP)
	rm -rf book/_build
	$(VENV)/bin/jupyter-book build -W --keep-going book/

browser: book   # the built book and JupyterLab in headless Chromium (/usr/bin/chromium); skips, saying why, without one
	$(PY) -m pytest tests/browser -q --instafail

execute: $(STAMP)   # re-run chapters in place (NOTEBOOKS="notebooks/01_memory_math.ipynb ..." for some; CELLS=id,id keeps only those cells' new outputs)
	$(PY) tools/execute_notebooks.py $(NOTEBOOKS) $(if $(CELLS),--cells $(CELLS))

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --notebook-dir=. $(if $(filter 0,$(shell id -u)),--allow-root)

clean:
	rm -rf runs book/_build
