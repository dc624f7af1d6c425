"""`ddtree serve` / `python -m ddtree.launch_server`: validate the flags before any weight is loaded, build the
engine and the OpenAI API, and serve it with uvicorn. SIGINT/SIGTERM stop accepting connections and let the
in-flight requests finish (a second signal forces exit); the engine thread stops after the last response."""

from __future__ import annotations

import logging
import signal
import sys

from ddtree.configs import ConfigError
from ddtree.server_args import ServerArgs, make_parser, resolve_server_args

logger = logging.getLogger("ddtree")


def prepare_args(argv: list[str]) -> ServerArgs:
    """Parse and resolve server flags; raises ConfigError (every problem at once) before loading weights."""
    ns = make_parser("ddtree serve").parse_args(argv)
    return resolve_server_args(ServerArgs(**vars(ns)))


def build_app(args: ServerArgs, **app_kw):
    """(FastAPI app, AsyncEngine) for resolved args; loads the weights. The engine thread starts with the app."""
    from ddtree.engine.engine import LLMEngine
    from ddtree.server.api import create_app
    from ddtree.server.async_engine import AsyncEngine
    from ddtree.server.metrics import ServerMetrics

    engine = LLMEngine(args)
    metrics = None
    if args.enable_metrics:
        longest_round = engine.spec.block_size if args.is_speculative else 1
        metrics = ServerMetrics(args.speculative_algorithm, longest_round)
    aengine = AsyncEngine(engine, metrics)
    return create_app(aengine, args, metrics, **app_kw), aengine


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = make_parser("ddtree serve").parse_args(argv)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()), format="[ddtree] %(message)s")
    try:
        args = resolve_server_args(ServerArgs(**vars(ns)))
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: invalid configuration: {problem}", file=sys.stderr)
        return 2
    import uvicorn

    app, _ = build_app(args)
    logger.info("serving %s (%s) on http://%s:%d", args.served_model_name, args.speculative_algorithm,
                args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    # NOTE: uvicorn re-raises the signal that stopped it once the drain is over; a no-op handler turns that
    # into a clean exit (status 0) instead of death by SIGTERM.
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda *_: None) for s in stops}
    try:
        uvicorn.Server(config).run()
    finally:
        for s in stops:
            signal.signal(s, previous[s])
    return 0
