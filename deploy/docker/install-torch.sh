#!/bin/sh
# Install torch into the image's venv, the build variant asked for and nothing else, before
# any other dependency (so a wrong variant fails in seconds, not after a 2 GB download).
#
#   install-torch.sh VARIANT WHEEL_DIR PYPROJECT [INDEX_URL]
#
# VARIANT is cpu, a CUDA tag (cu128, cu126, ...) or cuda; the version is pyproject's torch pin.
#   1. WHEEL_DIR (./wheels in the build context) holds torch-VERSION+VARIANT-cpXY-*.whl: that
#      wheel, its own dependencies (sympy, typing-extensions, ...; no other torch) from PyPI or
#      EXTRA_PIP_ARGS' mirror.
#   2. Else INDEX_URL is set: torch from that one index alone (--index-url, never as an extra
#      index, so pip never retries a second index for every other package).
#   3. Else VARIANT is cuda: torch==VERSION from PyPI (or EXTRA_PIP_ARGS' mirror), whose Linux
#      x86_64 wheel is the CUDA build that release was made with (no +cuXXX tag to pin).
#   3b. Else VARIANT is a CUDA tag: the PyTorch index for it, download.pytorch.org/whl/VARIANT.
#   4. Else (cpu, no wheel, no index): stop with the command that fills WHEEL_DIR. Plain PyPI
#      would serve the CUDA build, which is what this script exists to refuse.
# Afterwards torch's own variant is checked, and $TORCH_CONSTRAINT (/tmp/torch-constraint.txt)
# pins the installed torch so installing the other requirements cannot replace it.
# tests/compose runs this script with a stand-in pip (the CUDA path cannot be built here).
set -eu
variant=$1 wheels=$2 pyproject=$3 index=${4:-}
constraint=${TORCH_CONSTRAINT:-/tmp/torch-constraint.txt}
pin=$(python "$(dirname "$0")/deps.py" "$pyproject" | grep -iE '^torch *==' || true)
version=$(echo "$pin" | sed -E 's/^[Tt]orch *== *//; s/[ ;].*$//')
[ -n "$version" ] || { echo "error: pyproject.toml must pin torch==VERSION (found: '${pin:-nothing}')" >&2; exit 1; }
pyver=$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
pytag=cp$(echo "$pyver" | tr -d .)
wheel=$(ls "$wheels"/torch-"$version"+"$variant"-"$pytag"-"$pytag"-*.whl 2>/dev/null | head -n1 || true)

if [ -n "$wheel" ]; then
  echo "torch: $(basename "$wheel") from the build context's wheels/"
  # shellcheck disable=SC2086  # EXTRA_PIP_ARGS is a list of arguments
  pip install ${EXTRA_PIP_ARGS:-} "$wheel"
elif [ "$variant" = cuda ] && [ -z "$index" ]; then
  echo "torch: torch==$version from PyPI, a CUDA build (its wheel's own CUDA version)"
  # shellcheck disable=SC2086  # EXTRA_PIP_ARGS is a list of arguments
  pip install ${EXTRA_PIP_ARGS:-} "torch==$version"
elif [ -n "$index" ] || [ "$variant" != cpu ]; then
  index=${index:-https://download.pytorch.org/whl/$variant}
  echo "torch: torch==$version+$variant from $index (the only index of this pip call)"
  pip install --index-url "$index" "torch==$version+$variant"
else
  cat >&2 <<MSG
error: TORCH_VARIANT=cpu, but wheels/ in the build context has no torch-$version+cpu-$pytag-$pytag-*.whl,
and PyPI serves only the CUDA build of torch (~2 GB). Put the CPU wheel there first, either
  pip download torch==$version --index-url https://download.pytorch.org/whl/cpu --no-deps \\
      --only-binary :all: --python-version $pyver --platform manylinux_2_28_x86_64 -d wheels
or copy a local one:  cp /path/to/torch-$version+cpu-$pytag-$pytag-*.whl wheels/
(or pass --build-arg TORCH_INDEX_URL=<an index with torch==$version+cpu>).
MSG
  exit 1
fi

python - "$variant" <<'PY'
import sys, torch
variant = sys.argv[1]
if variant == "cpu" and torch.version.cuda:
    sys.exit(f"error: TORCH_VARIANT=cpu, but torch {torch.__version__} is a CUDA build")
if variant != "cpu" and not torch.version.cuda:
    sys.exit(f"error: TORCH_VARIANT={variant}, but torch {torch.__version__} has no CUDA")
print(f"torch {torch.__version__} (cuda {torch.version.cuda}) installed")
PY
# The distribution's own version: PyPI's CUDA wheel is 2.13.0 while torch.__version__ says +cu130.
python -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' > "$constraint"
