"""Machine facts every benchmark result carries."""
from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path


def machine_info(threads: int, device: str = "cpu", dtype: str = "float32") -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    info = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "load_avg_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "device": device,
        "dtype": dtype,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info
