"""One server's engine for resolved args: the `LLMEngine`, its metrics and its start-up warm-up behind
an `AsyncEngine`. The one-engine server and every `--dp-size` replica build it the same way."""

from __future__ import annotations

from ddtree.config import ServerArgs


def build_engine(args: ServerArgs, gc_freeze: bool = False):
    """The AsyncEngine over one LLMEngine and its metrics, for resolved args (loads the weights; the
    engine thread starts with the app): one server's engine, or one --dp-size replica's."""
    from ddtree.engine.engine import LLMEngine
    from ddtree.server.async_engine import AsyncEngine
    from ddtree.server.metrics import ServerMetrics

    engine = LLMEngine(args)
    metrics = None
    if args.enable_metrics:
        longest_round = engine.spec.block_size if args.is_speculative else 1
        metrics = ServerMetrics(args.speculative_algorithm, longest_round)
        metrics.set_round_costs(engine.round_costs())
    return AsyncEngine(
        engine,
        metrics,
        warmup=warmup_of(engine, args),
        overlap=not args.disable_overlap_schedule,
        gc_freeze=gc_freeze,
        max_queued=args.max_queued_requests,
    )


def warmup_of(engine, args):
    """The start-up warm-up (engine/warmup.py) the engine thread runs before serving, or None: with
    --skip-server-warmup, and on the CPU (nothing compiles there: no Triton, no graphs)."""
    if args.skip_server_warmup or engine.device.type != "cuda":
        return None
    from ddtree.engine.warmup import warm_up

    return lambda: warm_up(engine)
