"""`plugserve` command line: `plugserve backends [--kind K] [--json] [--explain]` and `plugserve serve`. Light to
import (no torch): `--help` answers at once; each command imports what it runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from plugserve.core.names import KINDS
from plugserve.server.launch import add_server_args, server_args_from


def backends_command(args: argparse.Namespace) -> int:
    from plugserve.backends_report import report_backends

    return report_backends(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plugserve", description="A serving core for DeepSeek-V3-style models "
                                     "whose kernels are plugins.")
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="what is installed, what is usable here and why, what auto picks")
    backends.add_argument("--kind", choices=KINDS, help="only this kind of backend")
    backends.add_argument("--json", action="store_true", help="machine-readable output")
    backends.add_argument("--explain", action="store_true",
                          help="also say why auto picks each backend, and show the MLA dispatch rule")
    backends.add_argument("--device", default=None, help="torch device to describe (default: cuda if present)")
    backends.set_defaults(run=backends_command)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                                description="Serve a DeepSeek-V2/V3 model over an OpenAI-compatible HTTP API.")
    add_server_args(serve)
    serve.set_defaults(run=lambda args: serve_command(args, serve))
    return parser


def serve_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from plugserve.server.launch import serve

    serve(server_args_from(args, parser))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
