"""The `ddtree` console script: one subcommand per job, each a thin wrapper over a module's `main`."""

from __future__ import annotations

import sys

USAGE = """usage: ddtree <command> [flags]

commands:
  generate        generate text offline (engine flags + generation flags; --help)
  check-config    validate a configuration and print its memory plan, without loading weights
  serve           run the OpenAI-compatible HTTP server (same as python -m ddtree.launch_server)
  train-target    pretrain a small Qwen3 target from a corpus
  train-drafter   train a DFlash drafter for a target
  bench           benchmarks: acceptance | rounds | serving | at-scale
  inflate         widen a small trained pair to a production shape (same logits)
"""


def _commands():
    return {
        "generate": ("ddtree.generate", "main"),
        "check-config": ("ddtree.config.check_config", "main"),
        "serve": ("ddtree.server.launch", "main"),
        "train-target": ("ddtree.tools.train.cli", "main"),
        "train-drafter": ("ddtree.tools.train.cli", "main"),
        "bench": ("ddtree.bench.cli", "main"),
        "inflate": ("ddtree.tools.inflate.cli", "main"),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    table = _commands()
    if cmd not in table:
        print(f"ddtree: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    module, func = table[cmd]
    import importlib

    if cmd.startswith("train-"):  # the trainer's parser has both as subcommands
        rest = [cmd, *rest]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
