"""Where the bundled demo pair lives: the repo's models/ folder, or $SPECD_MODELS_DIR."""
from __future__ import annotations

import os
from pathlib import Path

DEMO_NAMES = {"target": "specd-demo-target", "drafter": "specd-demo-drafter"}


def models_root() -> Path:
    env = os.environ.get("SPECD_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def demo_model_dir(role: str) -> Path:
    return models_root() / DEMO_NAMES[role]
