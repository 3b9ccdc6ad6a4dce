# The README's commands: `make demo` runs the main job, `make test` the suite.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test demo bench lint format clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# compat mode puts the checkout on sys.path, so a script run from the folder
	# that holds a clone named jdp/ imports the package, not the clone folder
	# as a namespace package.
	$(PY) -m pip install --quiet -e '.[test]' --config-settings editable_mode=compat
	touch $@

# ruff, the type checker (mypy, configured in pyproject.toml) on jdp/ and on the
# code of docs/ and notebooks/, and the import graph (layered, no cycles:
# tests/import_graph.py).
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) tests/typecheck_examples.py
	$(PY) tests/import_graph.py

format: $(VENV)/.installed
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# Two workers: many tests wait on subprocesses (launcher, notebooks, kill-resume),
# so two of them overlap well even on 2 cores (13.5 -> 10 min measured).
test: lint
	$(PY) -m pytest -q -n 2 --durations=15

demo: $(VENV)/.installed
	$(PY) -m jdp.demo

# The step against a hand-written one; per-call cost on a tiny model; per-device memory of the sharded
# optimizer; data_parallel, zero1 and fsdp on a 12-layer LM; end to end (fit vs a hand loop, compile time and cache); then
# PyTorch DDP when torch is installed ($(PY) -m pip install torch==2.13.0;
# skipped otherwise).
bench: $(VENV)/.installed
	$(PY) benchmarks/run.py
	$(PY) benchmarks/per_call.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/sharded.py
	$(PY) benchmarks/end_to_end.py --first-step
	$(PY) benchmarks/torch_ddp.py
	$(PY) benchmarks/exact_cost.py
	$(PY) benchmarks/audit.py

clean:
	rm -rf $(VENV) out bench-results
