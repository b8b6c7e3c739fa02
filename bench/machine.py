"""Machine facts every benchmark result carries."""
from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import time
from pathlib import Path


def machine_info(threads: int, device: str = "cpu", dtype: str = "float32") -> dict:
    import torch

    cpu, flags, ids = platform.processor() or "", set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not flags:
                cpu = line.split(":", 1)[1].strip()
            elif (key := line.split(":")[0].strip()) in ("cpu family", "model", "stepping") and not flags:
                ids[key] = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
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
        # A hypervisor may name two CPU generations alike ("AMD EPYC"): family / model tell them apart.
        "cpu_id": " ".join(f"{k.split()[-1]} {v}" for k, v in ids.items()),
        # What decides the CPU kernels (kernels/cpu_ops.py, cpu_bf16_matmul.cpp) and oneDNN's choices.
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma"))),
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


def read_bandwidth(mb: int = 512, iters: int = 10) -> dict:
    """Memory read bandwidth at the current torch thread count: median time of torch.sum over
    an mb-MB float32 tensor. Filled with ones, not torch.empty: pages never written are mapped
    to the shared zero page and read far faster than real memory."""
    import torch

    x = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    x.sum()  # warm-up: faults, caches, thread pool
    runs = []
    for _ in range(iters):
        t = time.perf_counter()
        x.sum()
        runs.append(time.perf_counter() - t)
    nbytes = x.numel() * x.element_size()
    return {"bytes": nbytes, "gb_s": nbytes / statistics.median(runs) / 1e9, "runs_s": runs,
            "threads": torch.get_num_threads()}


def write_result(out: Path, script: str, argv, info: dict, settings: dict, rows: list, t0: float, render) -> dict:
    """A bench run's record (machine with the load at the end, command, settings, rows, minutes
    elapsed since time.monotonic() was t0), written to out.json and, rendered, to out.md (printed)."""
    import json
    import sys

    info["load_avg_end"] = os.getloadavg()[0]
    result = {"machine": info, "command": " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)]),
              "settings": settings, "rows": rows, "elapsed_s": time.monotonic() - t0}
    out.parent.mkdir(exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return result


def cpu_name(m: dict) -> str:
    """A machine_info record's CPU as results name it: its name, and family / model where recorded."""
    return f"{m['cpu']}, {m['cpu_id']}" if m.get("cpu_id") else m["cpu"]


def machine_line(r: dict) -> str:
    """The results' closing line: the machine, threads and load of a write_result record."""
    m = r["machine"]
    return (f"Machine: {cpu_name(m)} ({' '.join(m.get('cpu_flags', []))}), {m['cores']} cores, torch threads "
            f"{m['threads']}, torch {m['torch']}; load average {m['load_avg_start']:.2f} at start, "
            f"{m['load_avg_end']:.2f} at end; {m['date']}; {r['elapsed_s'] / 60:.0f} min.")
