"""What `pip install specd` carries: the wheel built from the project holds every module of the
serving package (specd/, kernels, services: a package left out of pyproject's list is a module
missing on install) and no training code, which is its own package, specd-train (training/)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import specd

REPO = Path(specd.__file__).resolve().parent.parent
SERVED = {"specd": REPO / "specd", "specd/kernels": REPO / "kernels", "specd/gateway": REPO / "services" / "gateway",
          "specd/verifier": REPO / "services" / "verifier", "specd/drafter": REPO / "services" / "drafter"}


def _wheel(project: Path, out: Path) -> set[str]:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 68:
        pytest.skip(f"setuptools {setuptools.__version__} is older than pyproject's build requirement")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(project)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def _sources(prefix: str, root: Path) -> set[str]:
    return {f"{prefix}/{p.relative_to(root).as_posix()}" for p in root.rglob("*.py") if "__pycache__" not in p.parts}


def test_the_wheel_holds_every_serving_module_and_no_training(tmp_path):
    names = _wheel(REPO, tmp_path / "specd")
    expected = set().union(*(_sources(prefix, root) for prefix, root in SERVED.items()))
    assert not expected - names, f"modules missing from the wheel: {sorted(expected - names)[:10]}"
    training = [n for n in names if n.startswith("specd_train/") or "train_drafter" in n or "/demo/" in n]
    assert not training, training


def test_training_is_its_own_wheel(tmp_path):
    names = _wheel(REPO / "training", tmp_path / "train")
    assert _sources("specd_train", REPO / "training" / "specd_train") <= names
    assert not any(n.startswith("specd/") for n in names)


def test_training_commands_without_the_training_package_say_how_to_get_it():
    """A serving install (no specd_train): the commands are listed and answer one line."""
    code = ("import sys; sys.modules['specd_train'] = None\n"  # as if not installed: importing it fails
            "from specd.cli import main; sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, "train-drafter", "--threads", "2"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "pip install -e training" in run.stderr, run.stderr
    helped = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "drafter-data" in helped.stdout and "demo-models" in helped.stdout
