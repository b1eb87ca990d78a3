"""The `swarmlm` command: one subcommand per role, each defined next to the code it runs.

Subcommands are imported by name only when chosen, so `swarmlm --help` is instant and `swarm`
keeps importing nothing from `peer` or `client` (the dependency direction the design fixes).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

COMMANDS = {
    "demo": ("client.demo.cli", "run a whole swarm on this machine with the built-in model, chat, then stop"),
    "bootstrap": ("swarm.bootstrap", "run a DHT bootstrap node and print the --initial-peers to use"),
    "peer": ("peer.cli", "serve a span of a model's blocks"),
    "train": ("client.training.cli", "train a model with the swarm (or alone, --local, as the reference)"),
    "export": ("client.training.export", "save the swarm's current weights as a Hugging Face checkpoint"),
    "api": ("client.api.cli", "serve a model of the swarm over an OpenAI-compatible HTTP API"),
    "status": ("swarm.status", "show which models and blocks the swarm serves, and by whom"),
    "monitor": ("client.monitor.cli", "serve a live web page of the swarm (and its state as JSON)"),
    "bench": ("bench.cli", "measure the swarm against the local model and the bare wire"),
}


# flags renamed so that every duration says its unit (`--session-timeout-s`, like `--refresh-s`): the old spellings
# still parse, hidden from --help, so that scripts written for them keep working
RENAMED_FLAGS = {
    f"--{name}": f"--{name}-s"
    for name in (
        "alloc-timeout",
        "session-timeout",
        "session-lifetime",
        "write-timeout",
        "update-period",
        "rebalance-period",
        "matchmaking-time",
        "averaging-timeout",
        "load-state-timeout",
        "step-timeout",
        "request-timeout",
        "wait-for-peers",
    )
}


def accept_renamed_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let `parser` take the old spelling of each renamed flag it has, as a hidden alias of the new one."""
    for action in list(parser._actions):
        for old, new in RENAMED_FLAGS.items():
            if new in action.option_strings:
                parser.add_argument(
                    old,
                    dest=action.dest,
                    type=action.type,
                    help=argparse.SUPPRESS,
                    default=argparse.SUPPRESS,
                    metavar=action.metavar,
                )
    return parser


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: swarmlm COMMAND [options]   (swarmlm COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"swarmlm: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    configure_logging(os.environ.get("SWARMLM_LOG_LEVEL", "INFO").upper())
    module = importlib.import_module(COMMANDS[name][0])
    args = accept_renamed_flags(module.build_parser(f"swarmlm {name}")).parse_args(rest)
    if getattr(args, "cache_dir", "unset") is None:
        args.cache_dir = os.environ.get("SWARMLM_CACHE_DIR")
    try:
        return module.run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
