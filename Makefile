# jdp: set-up, the main job, tests, benchmarks. `make install demo` then `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Simulated CPU devices for the demo when there is no accelerator (ignored by GPUs).
DEVICES ?= 8
export XLA_FLAGS ?= --xla_force_host_platform_device_count=$(DEVICES)

.PHONY: install demo test test-long test-fast bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: install
	$(PY) examples/mnist.py --output-dir runs/demo

# The suite in JOBS pytest-xdist workers: every unit test and every system test (under
# tests/system/: they start processes, and wait on them, so two workers on 2 cores take about
# half the time of one) but the `long` ones, which make test-long runs. A worker takes one file
# at a time, in the order tests/conftest.py gives (files with system tests first), so a file's
# module fixtures run once. The 20 slowest tests are listed at the end.
JOBS ?= 2
test: install
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=20 -m "not long"

# The end-to-end runs make test leaves out (pytest -m long): the examples trained to their
# accuracy, jobs killed and resumed, multi-node elastic rounds, the benchmarks' smoke runs.
# Not in CI (13 minutes on 2 cores); `make test test-long` is the whole suite.
test-long: install
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=20 -m long

# The unit tests and doctests alone, nothing that starts a process and no long test
# (make test-long runs those): the loop while editing, in JOBS workers too (they compile on
# both cores: 3.3 instead of 5.1 minutes cold). XLA's compiled programs stay in .jax_cache/
# between runs: a warm run needs a third of the CPU.
test-fast: install
	JAX_COMPILATION_CACHE_DIR=$${JAX_COMPILATION_CACHE_DIR:-$(CURDIR)/.jax_cache} \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 $(PY) -m pytest -q -n $(JOBS) --dist worksteal -m "not system and not long"

# The PyTorch peer is optional: without it the report says the comparison was skipped.
bench: install
	$(PY) -m pip install -q -e ".[torch]" || echo "torch==2.13.0 not installable: skipping the PyTorch DDP comparison"
	$(PY) -m benchmarks --output BENCHMARKS.md

lint: install
	$(PY) -m pip install -q ruff
	$(PY) -m ruff check jdp tests examples benchmarks

clean:
	rm -rf $(VENV) runs build *.egg-info .jax_cache
