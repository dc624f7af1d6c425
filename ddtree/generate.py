"""`ddtree generate`: offline generation with the server's flags, a progress bar and per-run statistics."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import sys
import time

DEFAULT_PROMPTS = (
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
)


DESCRIPTION = (
    "Offline generation: the engine's flags (the server's, without its HTTP ones)\n"
    "plus the generation flags below."
)


def make_parser() -> argparse.ArgumentParser:
    """Every flag generate takes: the engine's (config.args.FLAG_GROUPS but the server's own,
    which would not act here and are refused) and its own. `--help` prints the short help
    (`print_help`); `--help=all` every flag's, `--help=GROUP` one group's."""
    from ddtree.config.args import FLAG_GROUPS, SERVER_ONLY_GROUPS
    from ddtree.config.args import make_parser as server_parser

    engine = tuple(g for g in FLAG_GROUPS if g not in SERVER_ONLY_GROUPS)
    p = server_parser("ddtree generate", engine, DESCRIPTION, add_help=False)
    p.add_argument(
        "-h",
        "--help",
        nargs="?",
        const="short",
        metavar="all|GROUP",
        help="this help; --help=all: every flag's help; --help=GROUP: one group's (e.g. "
        "--help=speculative)",
    )
    add_generation_flags(p.add_argument_group("generation"))
    return p


def add_generation_flags(g) -> None:
    g.add_argument(
        "--prompt",
        action="append",
        help=f"prompt text (repeatable); default: {len(DEFAULT_PROMPTS)} built-in code prompts",
    )
    g.add_argument(
        "--prompts-file",
        help='JSONL file, one {"prompt": text or token ids} per line (default: none)',
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="wrap prompts in the tokenizer's chat template (default: off)",
    )
    g.add_argument(
        "--max-tokens", type=int, default=96, help="new tokens per prompt (default: %(default)s)"
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 = greedy (default: %(default)s)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling mass; 1 = off (default: %(default)s)",
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="sample from the k most likely tokens; -1 = off (default: %(default)s)",
    )
    g.add_argument(
        "--seed", type=int, default=None, help="per-request sampling seed (default: unseeded)"
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past EOS up to --max-tokens (default: off)",
    )
    g.add_argument(
        "--compare-ar",
        action="store_true",
        help="also run plain AR decoding and report the speed-up; both runs go one "
        "request at a time (batch 1) unless --max-running-requests is given "
        "(default: off)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print only JSON on stdout, one object per output; the statistics go to "
        "stderr (default: off)",
    )


def print_help(parser: argparse.ArgumentParser, which: str) -> int:
    """`--help`: generate's own flags in full and the engine's flags by group, names only;
    `--help=all`: every flag's help; `--help=GROUP`: the groups whose title starts with GROUP."""
    import textwrap

    from ddtree.config.args import FLAG_GROUPS, SERVER_ONLY_GROUPS, flag

    engine = [g for g in FLAG_GROUPS if g not in SERVER_ONLY_GROUPS]
    if which == "all":
        parser.print_help()
        return 0
    if which != "short":
        from ddtree.config.args import make_parser as server_parser

        picked = tuple(g for g in engine if g.lower().startswith(which.lower()))
        if not picked:
            print(
                f"ddtree generate: --help={which}: no such group; groups: "
                + ", ".join(g.split()[0].lower() for g in engine),
                file=sys.stderr,
            )
            return 2
        server_parser("ddtree generate", picked, DESCRIPTION, add_help=False).print_help()
        return 0
    lines = []
    for title in engine:
        names = " ".join(flag(n) for n in FLAG_GROUPS[title])
        lines.append(
            textwrap.fill(
                names,
                width=100,
                initial_indent=f"  {title}: ",
                subsequent_indent="      ",
                break_on_hyphens=False,
            )
        )
    short = argparse.ArgumentParser(
        prog="ddtree generate",
        usage="%(prog)s [generation flags] [engine flags]",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        allow_abbrev=False,
        epilog="engine flags (the server's; --help=all for each one's help, --help=GROUP for one "
        "group's, e.g. --help=speculative):\n" + "\n".join(lines),
    )
    add_generation_flags(short.add_argument_group("generation"))
    short.print_help()
    return 0


def load_prompts(ns) -> list[str]:
    prompts = list(ns.prompt or [])
    if ns.prompts_file:
        with open(ns.prompts_file, encoding="utf-8") as f:
            prompts += [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts or list(DEFAULT_PROMPTS)


def histogram(lengths: list[int]) -> str:
    if not lengths:
        return "(no rounds)"
    counts = collections.Counter(lengths)
    top = max(counts.values())
    rows = [
        f"  {k:>3} | {'#' * max(1, round(40 * counts[k] / top))} {counts[k]}"
        for k in sorted(counts)
    ]
    return "\n".join(rows)


def run(args, prompts, params, label: str, chat: bool = False, tqdm_bar: bool = True):
    from ddtree.engine.engine import LLMEngine
    from ddtree.engine.outputs.emitter import RequestOutput

    engine = LLMEngine(args)
    if chat:
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise SystemExit("error: --chat needs a tokenizer with a chat template")
        prompts = [
            engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params, use_tqdm=tqdm_bar)
    elapsed = time.perf_counter() - t0
    outs = [RequestOutput.of(r) for r in reqs]
    tokens = sum(len(o.token_ids) for o in outs)
    lengths = [n for o in outs for n in o.accept_lengths]
    stats = {
        "label": label,
        "requests": len(outs),
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "rounds": len(lengths),
        "mean_accept_length": sum(lengths) / len(lengths) if lengths else 0.0,
    }
    return outs, stats, lengths


def main(argv: list[str]) -> int:
    from ddtree.config import ServerArgs, resolve_server_args
    from ddtree.engine.scheduling.request import SamplingParams
    from ddtree.models.configs import ConfigError

    parser = make_parser()
    ns = parser.parse_args(argv)
    if ns.help is not None:
        return print_help(parser, ns.help)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()), format="[ddtree] %(message)s")
    if ns.compare_ar and ns.max_running_requests is None:
        # The speed-up the docs quote is batch 1: at larger batches AR amortises its weight reads.
        ns.max_running_requests = 1
        logging.getLogger("ddtree").info(
            "--compare-ar: timing both runs at batch 1 (--max-running-"
            "requests 1); pass --max-running-requests N for batch N"
        )
    server_fields = {f.name for f in dataclasses.fields(ServerArgs)} - {"help"}
    try:
        args = resolve_server_args(
            ServerArgs(**{k: v for k, v in vars(ns).items() if k in server_fields})
        )
    except ConfigError as e:
        print(f"error: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    params = SamplingParams(
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        max_tokens=ns.max_tokens,
        ignore_eos=ns.ignore_eos,
        seed=ns.seed,
    )
    prompts = load_prompts(ns)
    try:
        outs, stats, lengths = run(args, prompts, params, args.speculative_algorithm, ns.chat)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, o in zip(prompts, outs):
        if ns.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": o.text,
                        "token_ids": o.token_ids,
                        "finish_reason": o.finish_reason,
                        "mean_accept_length": o.mean_accept_length,
                    }
                )
            )
        else:
            print(
                f"\n=== prompt: {prompt!r}\n{o.text if o.text else o.token_ids}\n--- "
                f"{len(o.token_ids)} tokens, finish={o.finish_reason}, rounds={o.rounds}, "
                f"mean accepted length={o.mean_accept_length:.2f}"
            )
    out = sys.stderr if ns.json else sys.stdout  # --json: stdout carries JSON only
    batch = batch_label(args.max_running_requests, len(prompts))
    print(
        f"\n[{stats['label']}, {batch}] {stats['tokens']} tokens in {stats['seconds']:.2f} s = "
        f"{stats['tokens_per_s']:.1f} tok/s, {stats['rounds']} rounds, "
        f"mean accepted length {stats['mean_accept_length']:.2f}",
        file=out,
    )
    print("accepted length per round (tokens emitted incl. bonus):", file=out)
    print(histogram(lengths), file=out)
    if ns.compare_ar and args.speculative_algorithm != "NONE":
        ar_args = dataclasses.replace(args, speculative_algorithm="NONE")
        ar_outs, ar_stats, _ = run(ar_args, prompts, params, "NONE")
        same = all(a.token_ids == b.token_ids for a, b in zip(outs, ar_outs))
        print(
            f"[NONE, {batch}] {ar_stats['tokens']} tokens in {ar_stats['seconds']:.2f} s = "
            f"{ar_stats['tokens_per_s']:.1f} tok/s",
            file=out,
        )
        print(
            f"speed-up {args.speculative_algorithm} over AR at {batch}: "
            f"{ar_stats['seconds'] / stats['seconds']:.2f}x (wall clock); "
            f"outputs identical to AR: {same}",
            file=out,
        )
    return 0


def batch_label(max_running: int, n_prompts: int) -> str:
    """The batch the timings were taken at: the engine runs at most --max-running-requests."""
    if max_running < n_prompts:
        return f"batch {max_running}"
    return f"batch {n_prompts} (all prompts at once)"
