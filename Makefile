# `make test` and `make train` set up everything on a fresh machine: they find a Python
# >= 3.12, create .venv, install the package with its extras, then run.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := tpu,optax,resnet,test,docs

# The first interpreter >= 3.12 among PATH's and pyenv's.
PYTHON_CANDIDATES := python3.13 python3.12 python3 $(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3)
FIND_PYTHON := for p in $(PYTHON_CANDIDATES); do \
  if $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then command -v $$p; exit 0; fi; \
done; exit 1

.PHONY: test lint docs format train bench clean

$(STAMP): pyproject.toml
	@base=$$($(FIND_PYTHON)) || { echo "Need Python >= 3.12 (jax 0.12 requires it): install python3.12 or put it on PATH." >&2; exit 1; }; \
	echo "Using $$base"; \
	[ -x $(PY) ] || $$base -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

# One worker per core; a file's tests stay on one worker, so its module fixtures run once.
test: $(STAMP) lint docs
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n auto --dist loadfile --durations=25 tests

# The formatter and linter (configured in pyproject.toml); `make format` applies them.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation (docs/, Sphinx with myst-parser): warnings are errors.
docs: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

train: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m resnet --config=resnet/configs/default.py --workdir=runs/digits

# TC_BENCH_FULL=1 make bench runs the full size sweep (4 KiB to 64 MiB).
bench: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q bench --benchmark-json=bench/results/latest.json
	JAX_PLATFORMS=cpu $(PY) -m bench.plot bench/results/latest.json

clean:
	rm -rf $(VENV) runs docs/_build docs/_generated docs/api/generated
