# The README's commands: `make demo` runs the main job, `make test` the suite.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test test-floor docs notebooks demo bench lint format clean

# The oldest JAX jdp supports, read from the pyproject's requirement.
JAX_FLOOR := $(shell sed -n 's/.*"jax>=\([0-9.]*\)".*/\1/p' pyproject.toml)
FLOOR_VENV ?= .venv-floor

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
# so two of them overlap well even on 2 cores (13.5 -> 10 min measured). Whole
# files go to a worker, longest first (tests/conftest.py), so each module
# fixture is built once and the workers end together.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder
test: lint
	$(PY) -m pytest -q $(XDIST) --durations=15

# The suites that exercise JAX's APIs, on the oldest supported jax and jaxlib.
$(FLOOR_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e '.[test]' 'jax==$(JAX_FLOOR)' 'jaxlib==$(JAX_FLOOR)' --config-settings editable_mode=compat
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -c "import jax; assert jax.__version__ == '$(JAX_FLOOR)', jax.__version__"
	$(FLOOR_VENV)/bin/python -m pytest -q $(XDIST) tests/test_step.py tests/test_exact.py \
	  tests/test_zoo.py tests/test_backends.py tests/test_strategies.py tests/test_fsdp.py \
	  tests/test_zero1.py tests/test_checkpoint.py tests/test_jax_private.py \
	  tests/test_collectives_in_loss.py tests/test_layouts.py tests/test_replication.py

# The docs site, warnings as errors, in out/site (tests/test_site.py builds and
# browses it too).
docs: $(VENV)/.installed
	$(PY) -m sphinx -b html -W --keep-going -q docs out/site

# Re-executes the notebooks and saves them with their outputs (the suite
# checks the saved outputs are what the notebooks produce now).
notebooks: $(VENV)/.installed
	$(PY) tests/test_notebooks.py

# The README's image is the default run's figure (tests/test_loop.py checks it).
demo: $(VENV)/.installed
	$(PY) -m jdp.demo
	cp out/demo/promises.png docs/images/demo.png

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
	$(PY) benchmarks/timing.py
	$(PY) benchmarks/pace.py --launchers mpirun srun k8s
	$(PY) benchmarks/pace.py --modes slow-loss --time-every 1 --hangs 0
	$(PY) benchmarks/survivors.py
	$(PY) benchmarks/import_time.py

clean:
	rm -rf $(VENV) $(FLOOR_VENV) out bench-results
