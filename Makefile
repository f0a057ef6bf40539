# Two commands do all the set-up on a fresh machine: `make app` and `make test`.
# GPU users: make TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126' ...
# A stock Linux machine without a GPU: PyPI's torch wheel for Linux is a multi-GB CUDA build;
# `make app CPU_TORCH=1` takes the CPU build from PyTorch's CPU index instead, and falls back to the
# plain pin when that index cannot be reached. Chosen by you, never probed: the default installs
# the plain pin from the configured package index alone.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
CPU_TORCH ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PORT ?= 8501

.PHONY: install dev app lab test test-gpu test-fast soak lessons lessons-execute bench chromium clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, from TORCH_SPEC: a bare `torch` would resolve to a multi-GB CUDA build
	$(if $(CPU_TORCH),$(PIP) install -q $(TORCH_SPEC) --index-url $(TORCH_CPU_INDEX) || \
		{ echo "the CPU index could not be used: installing the plain pin $(TORCH_SPEC)"; \
		  $(PIP) install -q $(TORCH_SPEC); },$(PIP) install -q $(TORCH_SPEC))
	touch $@

$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(PIP) install -q -e '.[app,lab]'
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(PIP) install -q -e '.[app,lab,dev]'
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev

app: $(VENV)/.installed
	$(VENV)/bin/streamlit run app/streamlit_app.py --server.address 127.0.0.1 \
		--server.port $(PORT) --server.headless true --browser.gatherUsageStats false

lab: $(VENV)/.installed
	$(VENV)/bin/jupyter lab lessons/ --ip 127.0.0.1 $$([ "$$(id -u)" = 0 ] && echo --allow-root)

# Debian's chromium for the browser tests. Installed when missing and we may (root + apt);
# otherwise the browser tests say why and skip. CI (CI=true) requires it.
chromium:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)) \
		|| echo "chromium could not be installed: browser tests will skip"; \
	else echo "chromium not installed and cannot install it here: browser tests will skip"; fi
	@if [ "$$CI" = true ] && ! command -v chromium >/dev/null 2>&1; then echo "CI needs chromium"; exit 1; fi

# Two pytest workers, each taking whole test files (pytest-xdist --dist loadfile: a file's session
# fixtures, such as the notebooks' nbval jobs, stay in one worker). One process leaves a core idle
# a quarter to a third of the time (single-threaded tests, waits on servers and process starts):
# 596 s in one process, 436 s in two here (docs/suite-time-2026-12-07). TEST_JOBS=0: one process.
# Tests marked `alone` hold a wall-time bound on a real server (a class's charts within 10 s):
# they run after the workers, with the machine to themselves; beside the other worker's ranks,
# on a slow night, 16 of 20 charts came at 10.0-10.4 s (docs/suite-time-2026-12-07, section 6).
TEST_JOBS ?= 2
WORKERS = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)
test: $(VENV)/.dev chromium
	$(PY) tools/make_lessons.py --check
	rc=0; $(PY) -m pytest -q $(WORKERS) -m "not alone" || rc=$$?; \
	$(PY) -m pytest -q -m alone || rc=$$?; exit $$rc

# The suite SOAK_N times (default 3), each from a fresh clone of HEAD, with SOAK_LOAD busy loops
# beside it (default 0); prints every failure
soak:
	SOAK_N=$(or $(SOAK_N),3) SOAK_LOAD=$(or $(SOAK_LOAD),0) tools/soak.sh

test-fast: $(VENV)/.dev
	rc=0; $(PY) -m pytest -q -m "not browser and not notebooks and not alone" $(WORKERS) || rc=$$?; \
	$(PY) -m pytest -q -m alone || rc=$$?; exit $$rc

# After editing lessons/src/*.ipynb: regenerate the learner and solved copies ...
lessons: $(VENV)/.dev
	$(PY) tools/make_lessons.py

# ... or, when a checked output or a grader changed, re-run the sources to store their outputs first
lessons-execute: $(VENV)/.dev
	$(PY) tools/make_lessons.py --execute

bench: $(VENV)/.installed
	$(PY) -m parallel_mini.bench dp

clean:
	rm -rf $(VENV) *.egg-info

# The checks of a machine with a CUDA GPU (tests/test_gpu.py, docs/gpu.md): the CUDA path at world
# size 1 and gloo ranks with a core each. Skips cleanly without a GPU. GPU_PY=python3 runs them
# with a Python that already has torch (a lent machine with no network), without the venv.
GPU_PY ?=
test-gpu:
	$(if $(GPU_PY),,$(MAKE) $(VENV)/.dev)
	$(or $(GPU_PY),$(PY)) -m pytest -q -m gpu tests/test_gpu.py $(GPU_ARGS)
