"""Regenerate the committed gRPC stubs (specd/v1/*_pb2*.py) from protos/specd/v1/*.proto.

    python protos/generate.py [--out DIR]

tests/services/test_protos.py regenerates into a temporary directory and fails when the
committed stubs differ (edit the .proto, run this, commit both).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
REPO = PROTO_ROOT.parent


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "specd" / "v1").glob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out / "specd" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO)
    for path in generate(parser.parse_args().out):
        print(path, file=sys.stderr)
