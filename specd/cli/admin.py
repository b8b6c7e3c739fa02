"""`specd drafters list | add NAME ADDR | remove NAME | swap --old NAME --image IMAGE`: the verifier's
drafter pool, over gRPC (swap also drives Docker: specd/cli/docker_swap.py)."""
from __future__ import annotations

import argparse
import json

HELP = "list, add, remove or swap (Docker) the verifier's drafters at runtime"
STATUS_FIELDS = ("name", "address", "method", "state", "trusted", "acceptance_rate", "draft_tokens", "propose_p50_ms",
                 "timeouts", "last_error")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specd.rpc import auth

    p.add_argument("--verifier", default="127.0.0.1:50051", help="verifier gRPC address (default 127.0.0.1:50051)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the verifier")
    auth.add_arguments(p, server=False, client=True)  # default: the secret `specd up` left, if any
    sub = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    ls = sub.add_parser("list", help="drafters with health, acceptance and latency")
    ls.add_argument("--json", action="store_true", help="one JSON object per drafter")
    add = sub.add_parser("add", help="register a running drafter service")
    add.add_argument("name")
    add.add_argument("address", help="host:port of the drafter")
    add.add_argument("--trusted", action="store_true",
                     help="use its sparse q (it must hold the stack's shared secret); default: one-hot verification")
    rm = sub.add_parser("remove", help="drain and remove a drafter")
    rm.add_argument("name")
    rm.add_argument("--no-drain", action="store_true", help="drop in-flight proposals instead of draining")
    from specd.cli import docker_swap

    docker_swap.add_arguments(sub)


def status_dict(status) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(status, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)


def run(args) -> int:
    import grpc

    from specd.rpc import auth
    from specd.v1 import verifier_pb2, verifier_pb2_grpc

    with auth.sync_channel(args.verifier, auth.from_args(args, auth.up_token_file(args.verifier)), auth.VERIFIER) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        try:
            if args.action == "list":
                drafters = stub.ListDrafters(verifier_pb2.ListDraftersRequest(), timeout=args.timeout).drafters
                _print_list([status_dict(d) for d in drafters], args.json)
            elif args.action == "add":
                reply = stub.RegisterDrafter(verifier_pb2.RegisterDrafterRequest(
                    name=args.name, address=args.address, trusted=args.trusted), timeout=args.timeout)
                print(json.dumps(status_dict(reply.drafter)))
            elif args.action == "swap":
                from specd.cli.docker_swap import swap

                return swap(args, stub)
            else:
                stub.RemoveDrafter(verifier_pb2.RemoveDrafterRequest(name=args.name, drain=not args.no_drain),
                                   timeout=args.timeout)
                print(f"removed {args.name}")
        except grpc.RpcError as e:
            raise RuntimeError(f"{e.code().name.lower()}: {e.details()}") from None
    return 0


def _print_list(rows: list[dict], as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    if not rows:
        print("no drafters")
        return
    table = [STATUS_FIELDS] + [tuple(_cell(r.get(f)) for f in STATUS_FIELDS) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(STATUS_FIELDS))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "" if value is None else str(value)
