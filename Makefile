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

# The whole stack on this machine: gateway on :8000, verifier, a draft_model and an ngram
# drafter, all on the bundled demo pair. Ctrl-C stops it.
up: install
	$(VENV)/bin/specd up

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest tests

bench-engine: install
	$(PY) bench/engine.py --threads $(THREADS)

clean:
	rm -rf $(VENV) build *.egg-info

# Docker: the images on a local base image (deploy/build-base-image.sh: debootstrap, for
# machines without an image registry; SPECD_BASE_IMAGE=python:3.11-slim skips it), then
# compose.yaml end to end (tests/compose, -m docker). Leaves no containers behind.
.PHONY: compose-test
SPECD_BASE_IMAGE ?= specd-base:bookworm
compose-test: install
	if [ "$(SPECD_BASE_IMAGE)" = "specd-base:bookworm" ]; then deploy/build-base-image.sh; fi
	SPECD_BASE_IMAGE=$(SPECD_BASE_IMAGE) $(PY) -m pytest -m docker tests/compose -v -s
