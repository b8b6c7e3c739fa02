# The two commands of the README. Both set up everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
THREADS ?= 2

.PHONY: up test install bench-engine clean

$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(PY)
	$(PY) -m pip install -e ".[dev]"

# Until the services exist (issue 5), `up` runs the engine offline on the bundled demo target.
up: install
	$(VENV)/bin/specd generate --threads $(THREADS) --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest tests

bench-engine: install
	$(PY) bench/engine.py --threads $(THREADS)

clean:
	rm -rf $(VENV) build *.egg-info
