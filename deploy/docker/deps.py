"""Print specd's requirements from pyproject.toml, one per line, for the images' dependency layer.

The images install these first (a layer that only changes with pyproject.toml) and the
source afterwards with --no-deps (a small layer that changes with every commit).

    python deps.py pyproject.toml [--extra NAME ...] [--without NAME ...]

--extra adds an optional-dependency group when pyproject defines it (others are skipped, so
an image can ask for e.g. `otel` before that extra exists); --without drops a requirement by
project name (the gateway image drops torch: the gateway never imports it).
"""
import argparse
import re
import tomllib

p = argparse.ArgumentParser()
p.add_argument("pyproject")
p.add_argument("--extra", action="append", default=[])
p.add_argument("--without", action="append", default=[])
args = p.parse_args()

with open(args.pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
reqs = list(project["dependencies"])
for extra in args.extra:
    reqs += project.get("optional-dependencies", {}).get(extra, [])
drop = {n.lower() for n in args.without}
for req in reqs:
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower()
    if name not in drop:
        print(req)
