# Every target builds or refreshes .venv by itself.
# CPU by default: torch is pinned to the CPU build before anything else pulls a CUDA one.
# With a GPU, install your own torch into .venv first (or run `make TORCH_SPEC=torch ...`):
# an already-importable torch is kept as it is.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.gpuopt-installed
PIP        := $(BIN)/python -m pip install --quiet --disable-pip-version-check
# The GPU machine has its own CUDA torch and no package index: use its python3 (or .venv's, if
# there is one) with the repo on PYTHONPATH. Of our dependencies its image may lack torchinfo
# (imported by the callbacks; lightning, nvidia-ml-py, psutil, rich and PyYAML are usually there):
# `make gpu-wheels` on a machine with an index saves it into .whl/, and the GPU targets install
# .whl/*.whl into GPU_SITE first.
BENCH_PY   ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_SITE   ?= /tmp/gpuopt-site
GPU_ENV     = PYTHONPATH=$(CURDIR)$(if $(wildcard .whl/*.whl),:$(GPU_SITE))
GPU_WHEELS  = $(if $(wildcard .whl/*.whl),$(BENCH_PY) -m pip install -q --no-index --no-deps --no-compile \
              --disable-pip-version-check --upgrade --target $(GPU_SITE) .whl/*.whl &&)
OUT        ?= .

.PHONY: demo test test-min lint test-gpu gpu-check gpu-wheels bench bench-gpu clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

# the groups of tests/ (unit, integration, ddp) on 2 workers; the DDP launch stays on one of them
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

LINT_PATHS := lightning_gpuopt tests examples benchmarks

# ruff and mypy are in the [dev] extra; their settings are in pyproject.toml
lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

# The suite against the oldest versions pyproject.toml allows, in its own venv (.venv-min):
# lightning, pytorch-lightning, fsspec, torchinfo, nvidia-ml-py, rich, PyYAML, jsonargparse and psutil
# pinned to their floors by ci/min-constraints.txt. torch is NOT at its floor: only the
# TORCH_SPEC CPU wheel is at hand on CI (any other torch drags in GBs of CUDA packages),
# so the torch floor in pyproject.toml is read from the APIs used, not tested here.
MIN_VENV  := .venv-min
MIN_STAMP := $(MIN_VENV)/.gpuopt-installed
MIN_PIP   := $(MIN_VENV)/bin/python -m pip install --quiet --disable-pip-version-check

$(MIN_STAMP): pyproject.toml Makefile ci/min-constraints.txt
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -c "import torch" 2>/dev/null || $(MIN_PIP) "$(TORCH_SPEC)"
	$(MIN_PIP) -c ci/min-constraints.txt -e ".[dev]"
	$(MIN_VENV)/bin/python -m pip list --disable-pip-version-check 2>/dev/null \
	    | grep -iE '^(torch|lightning|pytorch-lightning|fsspec|torchinfo|nvidia-ml-py|rich|PyYAML|jsonargparse|psutil|transformers) '
	touch $(MIN_STAMP)

test-min: $(MIN_STAMP)
	$(MIN_VENV)/bin/python -m pytest -q -n 2 --dist loadgroup

GPU_BENCHMARKS := benchmarks/overhead.py benchmarks/data_wait_accuracy.py benchmarks/dataloader.py \
                  benchmarks/estimate_accuracy.py benchmarks/memory_fill.py
# the search comparison and the OOM recovery run under a simulated budget, the same on any machine
BENCHMARKS := $(GPU_BENCHMARKS) benchmarks/search_vs_lightning.py benchmarks/allocator_accuracy.py \
              benchmarks/oom_recovery.py

bench: $(STAMP)
	for script in $(BENCHMARKS); do $(BIN)/python $$script || exit 1; done

# the CUDA paths (events, NVML, max_memory_allocated, pinned memory); skipped without a GPU.
# Prints a table of the figures each test measured (for benchmarks/RESULTS.md).
test-gpu:
	$(GPU_WHEELS) $(GPU_ENV) GPUOPT_FIGURES=$(OUT)/test_gpu.md $(BENCH_PY) -m pytest -q -p no:cacheprovider tests/gpu

# The calibration on a real card, at most 5 minutes on one H100 (benchmarks/gpu_check.py):
# writes $(OUT)/gpu_check.json and $(OUT)/gpu_check.md. Without a card: the quick dry run on a simulated
# H100 that tests/integration/test_gpu_check.py runs (GPU_CHECK_ARGS=--full: the whole plan, CPU minutes).
gpu-check:
	$(GPU_WHEELS) $(GPU_ENV) $(BENCH_PY) benchmarks/gpu_check.py --out $(OUT) $(GPU_CHECK_ARGS)

gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: -d .whl torchinfo==1.8.0

bench-gpu:
	$(GPU_WHEELS) for script in $(GPU_BENCHMARKS); do $(GPU_ENV) $(BENCH_PY) $$script --accelerator gpu || exit 1; done

clean:
	rm -rf $(VENV) $(MIN_VENV) lightning_logs benchmarks/_runs .pytest_cache
