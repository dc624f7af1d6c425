"""`ddtree bench <acceptance | rounds | serving | prefix-cache | at-scale>`."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHES = {
    "acceptance": (
        "ddtree.bench.acceptance",
        "mean accepted length over DDTree budgets, "
        "shadow-linear and temperatures (the engine end to end)",
    ),
    "rounds": (
        "ddtree.bench.rounds",
        "per-round cost of AR / DFLASH / DDTREE on a random "
        "Qwen3-8B-shaped pair against the memory floor (--smoke: seconds on the CPU)",
    ),
    "serving": (
        "ddtree.bench.serving",
        "drive a running server: throughput, TTFT, TPOT, latency, accept length",
    ),
    "prefix-cache": (
        "ddtree.tools.studies.prefix_cache",
        "the prefix cache on vs --disable-radix-cache: multi-turn (shared system prompt) and "
        "no-sharing workloads against two servers; TTFT / throughput targets checked",
    ),
    "at-scale": (
        "ddtree.tools.studies.at_scale",
        "on the GPU: inflate the embedded pair to a production "
        "shape, serve NONE / DFLASH / DDTREE, sweep concurrency; one table + JSON + PNG",
    ),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<12} {what}" for name, (_, what) in BENCHES.items())
    return (
        f"usage: ddtree bench <{' | '.join(BENCHES)}> [flags]\n\nsubcommands:\n{rows}\n\n"
        "ddtree bench SUBCOMMAND --help lists a subcommand's flags and their defaults."
    )


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends '(default: X)' to a flag's help unless the help already says its default; a switch
    shows '(default: off)'."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHES:
        print(usage(), file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:]) or 0)
