"""`ddtree check-config <server flags>`: resolve the flags against config.json files and print the memory plan.

Never loads weights (and imports torch only on a GPU machine, to read its memory size), so it answers in a
fraction of a second. Exit status: 0 valid, 2 invalid configuration or bad flags.
"""

from __future__ import annotations

import logging
import sys

from ddtree.configs import ConfigError
from ddtree.memory_plan import memory_plan
from ddtree.server_args import ServerArgs, cli_fields, make_parser, resolve_server_args

logger = logging.getLogger("ddtree")


def _log_handler(level: str) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[ddtree] %(levelname)s %(message)s"))
    handler.setLevel(level.upper())
    return handler


def format_resolved(args: ServerArgs) -> str:
    lines = ["resolved configuration (non-default fields):"]
    for f in cli_fields():
        value = getattr(args, f.name)
        if value != f.default:
            lines.append(f"  {f.name:<34} {value}")
    t, d = args.target_config, args.drafter_config
    if t is not None:
        kind = f"hybrid ({len(t.linear_layer_ids)} GDN + {len(t.attention_layer_ids)} attention layers)" \
            if t.is_hybrid else f"dense ({t.num_hidden_layers} layers)"
        lines.append(f"target:  {t.architecture}, {kind}, hidden {t.hidden_size}, vocab {t.vocab_size}")
    if d is not None:
        lines.append(f"drafter: {d.num_hidden_layers} layers, block {d.block_size}, taps "
                     f"{list(d.target_layer_ids)}, mask {d.mask_token_id}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check-config"]:
        argv = argv[1:]
    parser = make_parser("ddtree check-config")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="plan for a device of this size instead of the local GPU / host RAM")
    try:
        ns = vars(parser.parse_args(argv))
    except SystemExit as e:
        return int(e.code or 0)
    device_gib = ns.pop("device_memory_gib")
    handler, old_level = _log_handler(ns["log_level"]), logger.level
    logger.addHandler(handler)
    logger.setLevel(min(handler.level, logger.getEffectiveLevel()))
    try:
        args = resolve_server_args(ServerArgs(**ns))
    except ConfigError as e:
        print("error: invalid configuration:", file=sys.stderr)
        for line in e.problems:
            print(f"  - {line}", file=sys.stderr)
        return 2
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    plan = memory_plan(args, None if device_gib is None else int(device_gib * 2**30))
    print(format_resolved(args))
    print(plan.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
