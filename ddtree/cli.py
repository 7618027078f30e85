"""The `ddtree` command. Subcommands import their heavy dependencies (torch) only when they run,
so client commands work on machines without torch."""

from __future__ import annotations

import argparse
import sys


def _make_tiny_model(args: argparse.Namespace) -> None:
    from modeling.tiny import make_tiny_target

    path = make_tiny_target(args.directory, seed=args.seed)
    print(f"tiny target written to {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding over gRPC")
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("make-tiny-model", help="write a small random Qwen3 checkpoint (HF format)")
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
