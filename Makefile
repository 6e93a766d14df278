# zero-course: `make train` runs the main job, `make test` runs everything CI runs, `make lab` opens the course.
PYTHON ?= python3
# bash: the test streams use pipefail
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed's just-in-time ops, built once per environment (labs.env.extensions_dir uses the same folder)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
# glibc malloc for every process `make test` starts (pytest, the kernels, labs and its ranks), as labs.env gives CPU
# ranks wherever they start (MALLOC_TUNABLES; tests/test_env.py checks the two agree): transparent huge pages, so the
# kernel zeroes fresh memory 2 MiB at a time, not in 4 KiB faults (glibc >= 2.35; tests/test_train.py ran in 54 s
# instead of 69 on a 2-core VM), and freed memory kept for reuse instead of handed back to be zeroed again (glibc >=
# 2.26; labs/env.py has the measurements). Only for `make test`, whose processes all end with it: a kernel of `make
# lab` would hold its peak. Your own GLIBC_TUNABLES wins.
MALLOC_KEEP := glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296:$\
  glibc.malloc.top_pad=268435456
TEST_TUNABLES := $(if $(filter undefined,$(origin GLIBC_TUNABLES)),$\
  glibc.malloc.hugetlb=1:$(MALLOC_KEEP),$(GLIBC_TUNABLES))

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

.PHONY: train train-run test tests-stream chapters-stream unit notebooks book browser lab execute clean

# pip compiles every module it installs to bytecode (about 35 of the 77 s this takes on a 2-core VM): keep it. With
# `--no-compile` (tried 2026-12-05) nothing was compiled where PYTHONDONTWRITEBYTECODE is set, as on this course's
# development VMs, and every process compiled torch again: 3.4 s of CPU to import it instead of 1.6.
# DeepSpeed's CPU Adam op (chapter 3's offload runs and several tests) compiles once per environment, about 90 s of
# CPU: started as soon as torch and DeepSpeed are in (their versions pinned by requirements.txt), it runs beside the
# rest of the install, which keeps one core of two busy (tools/build_cpu_adam.py, its output in the log below). If it
# fails, the first run that needs the op tries again and shows why. Bounded in time (the build script leaves through
# torch's cleanup, which removes its lock file); a Ctrl-C to make lets it finish in the background.
BUILD_LOG := $(VENV)/build_cpu_adam.log
$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements.txt torch deepspeed
	timeout 900 $(PY) tools/build_cpu_adam.py > $(BUILD_LOG) 2>&1 & build=$$!; \
	  $(PY) -m pip install -q -r requirements.txt && \
	  $(PY) -m pip install -q --no-deps -r requirements-nodeps.txt && \
	  $(PY) -m pip install -q --no-deps --no-build-isolation -e .; installed=$$?; \
	  wait $$build || echo "warning: DeepSpeed's CPU Adam op did not build ahead (see $(BUILD_LOG))"; \
	  exit $$installed
	touch $(STAMP)

# GPU hosts also get requirements-gpu.txt (Liger Kernel: the GPU defaults' LOSS=liger KERNELS=liger); CPU machines,
# CI's among them, never install it, and `make test` does not ask for it. GPU is read from .venv's torch when make
# starts, before a fresh clone has a .venv: `train` builds it, then a second make reads GPU (and the knobs) again.
GPU_STAMP := $(VENV)/.installed-gpu
$(GPU_STAMP): requirements-gpu.txt $(STAMP)
	$(PY) -m pip install -q -r requirements-gpu.txt
	touch $(GPU_STAMP)

train: $(STAMP)
	$(MAKE) --no-print-directory train-run

train-run: $(if $(filter 1,$(GPU)),$(GPU_STAMP),$(STAMP))
	$(VENV)/bin/labs train --preset $(PRESET) --config $(CONFIG) --steps $(STEPS) --out $(OUT) \
	  --loss $(LOSS) --kernels $(KERNELS) --activation-checkpointing $(CHECKPOINTING) $(if $(NPROC),--nproc $(NPROC))

# `make test` runs two streams side by side on two cores (`make unit` alone kept 1.5 of 2 cores busy: rank start-up,
# rendezvous, kernels waiting on their ranks): the unit tests, then chapters 0, 9 and 10 (they train nothing new:
# the quickstart's run is a test's, 9 and 10 read results/); and chapters 1-8, then the book and its browser tests
# (the book is built from the notebooks as committed, so it need not wait for the chapters to run). Each line is
# prefixed with what printed it. A third stream was tried on 2026-12-05 and reverted: the two cores are the limit. One
# cache of finished runs serves both (labs/runcache.py): a run the tests launched is not trained again when a chapter
# asks for the very same run (the quickstart's 30-step run is tests/test_train.py's); a chapter that asks while a test
# trains it waits for it. The chapters write their runs under the same temporary folder (LABS_RUNS), not into runs/,
# removed when the target ends. The launch report at the end says how many runs were trained or reused and which took
# longest (tools/). Fresh clones on this course's 2-core VM, install included (about 2 minutes):
# - 2026-12-07, 24:52: 57 runs trained in 1,278 s of summed run time, about 60% of a tiny run being start-up, mostly
#   importing torch, DeepSpeed and Qwen2, even with each CPU rank forked after its launcher's imports (fork_launcher);
# - then 19:04 with each launcher forked from a warm server that did those imports once per notebook or pytest session
#   (labs/prefork.py: the same runs in 810 s; unit tests 15:30 with the book after them, chapters 1-8 14:12);
# - then 19:41 with CPU Adam built during the install (2:38 instead of 1:57; chapters 1-8 13:01, unit tests 15:42,
#   701 s of runs): the chapters were no longer the longer stream, so the book and browser tests moved to theirs;
# - then 18:01 (install 2:24; unit tests 15:22; chapters 1-8 12:30, then 0, 9 and 10, the book and its browser tests;
#   689 s of runs), and 19:36 for the next commit (2:22; 17:03; 13:50; 753 s: both streams slower, this VM's spread).
#   User + system CPU no longer counts the warm servers (their parent exits first).
# - 2026-12-07 again (a slower day on the same VM: 0cd5295 took 23:50, install 3:33): 17:53 (install 2:19; unit tests
#   14:14; chapters 1-8 13:07; 608 s of runs) once a labs process's children (a test's `labs train`, chapter 6's nodes)
#   fork from its warm server instead of each starting one (42 servers in one make test before, ~35 for them).
# - 2026-12-07, later (the same VM, within one hour): 53b65d0 17:25 (install 2:34; unit tests 13:38; chapters 1-8 12:27,
#   then 0, 9 and 10, the book and its browser tests: the longer stream), then 15:47 (2:10; 12:41 then 0, 9 and 10;
#   11:05 then the book) with freed memory kept for reuse (MALLOC_KEEP), chapter 8's Trainer job trained once for it
#   and a test, and chapters 0, 9 and 10 moved to the unit tests' stream. Peak memory in use: 5.7 GiB, then 7.9 GiB.
#   At the session's last commit, again paired: 17:40 (2:37; unit tests 14:00; chapters 1-8 12:22) against 53b65d0's
#   19:00 forty minutes later (2:46; 15:13; 13:45): the VM had slowed, the gain held (make test 15:03 against 16:14).
# - 2026-12-07, afternoon (the VM slower still: the code-independent install took 2:56-3:16 against 1:59 at noon):
#   68c1ab6 (chapters 3-8 revised, chapter 3 with two more launcher probes, chapter 4 a 25 s fused-loss cell) 17:09
#   (install 3:16; unit tests 15:46; chapters 1-8 14:20) against 7e145f0's 17:40 twenty minutes later (2:56; 16:25;
#   14:42; one browser test met a JupyterLab HTTP 500 there). At noon b7c77d1 took 13:13 (1:59).
# - 2026-12-07, evening (install 3:07-3:46 throughout): 9b9e945 22:20 and 21:20 two hours apart; b0c3530 20:46;
#   3542fd6 22:23; 91f94fa 20:12 (install 3:13; unit tests 15:40; chapters 1-8 14:15). vmstat: 0-2% idle through the
#   tests (only pip leaves a core idle), so a third stream cannot help. Unit tests alone: 13:10, 779 of 791 s in the
#   120 tests that start processes; a tiny step is 0.56 s, most of it the 151,936-word LM head's products.
# - 2026-12-07, night (a new VM, about 1.8x as fast: unit tests alone 7:56 against 13:10): cfae903 11:10 and 11:35
#   (install 1:50 and 1:48; make test 9:20 and 9:47), 4fedd4d 12:30 and 11:01 (2:10 and 1:50; 10:20 and 9:11): the same
#   within this VM's spread. Unit tests 8:29-9:42 with chapters 0, 9 and 10 after them; chapters 1-8 8:01-8:38, then
#   the book (27 s) and its browser tests (30-35 s): the streams are even.
# CI took 1,015-1,758 s on its machines in the stops before (1,177 s for 53b65d0, 1,114 s for 7e145f0, 1,283 s for
# 9b9e945); the aim is under 20 minutes.
LATE_CHAPTERS := notebooks/00_quickstart.ipynb notebooks/09_qwen7b_on_gpu.ipynb notebooks/10_zenflow.ipynb
EARLY_CHAPTERS := $(filter-out $(LATE_CHAPTERS),$(sort $(wildcard notebooks/*.ipynb)))
test: export GLIBC_TUNABLES = $(TEST_TUNABLES)
test: $(STAMP)
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	  { LABS_RUN_CACHE=$$cache LABS_RUNS=$$cache/runs $(MAKE) --no-print-directory -j2 tests-stream chapters-stream; \
	    code=$$?; $(PY) tools/launch_report.py "$$cache"; exit $$code; }

# make's own -j2 starts the two streams: a shell's `&` would start them with SIGINT ignored, which the Ctrl-C tests
# (tests/test_run_control.py) would inherit
tests-stream: $(STAMP)
	set -o pipefail; $(MAKE) --no-print-directory unit 2>&1 | sed -u 's/^/unit| /'; unit=$$?; \
	  $(MAKE) --no-print-directory notebooks NOTEBOOK_FILES="$(LATE_CHAPTERS)" 2>&1 | sed -u 's/^/chapters 0, 9, 10| /'; \
	  exit $$(( unit || $$? ))

chapters-stream: $(STAMP)
	set -o pipefail; $(MAKE) --no-print-directory notebooks NOTEBOOK_FILES="$(EARLY_CHAPTERS)" 2>&1 | \
	  sed -u 's/^/chapters 1-8| /'; early=$$?; \
	  $(MAKE) --no-print-directory book browser 2>&1 | sed -u 's/^/book| /'; \
	  exit $$(( early || $$? ))

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
