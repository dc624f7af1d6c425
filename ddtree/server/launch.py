"""`ddtree serve` / `python -m ddtree.launch_server`: validate the flags before any weight is loaded, build the
engine and the OpenAI API, and serve it with uvicorn.

Shutdown (`DrainingServer`): SIGTERM stops accepting connections and lets in-flight requests finish
for up to --graceful-shutdown-timeout seconds; then, or at a second SIGTERM, or at a SIGINT, every
in-flight request is ended with an error (503 `server_shutting_down`: a JSON body, or an SSE error
event then `[DONE]` for a stream). The engine thread stops after the last response and the process
exits 0. One more signal after that forces uvicorn out without waiting for connections (still exit
0, the engine thread joined).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from ddtree.config import ServerArgs, make_parser, resolve_server_args
from ddtree.models.configs import ConfigError
from ddtree.models.sources import weight_problems
from ddtree.server.build import build_engine
from ddtree.server.gc_watch import gc_freeze_on

logger = logging.getLogger("ddtree")


def prepare_args(argv: list[str]) -> ServerArgs:
    """Parse and resolve server flags; raises ConfigError (every problem at once) before loading weights."""
    ns = make_parser("ddtree serve").parse_args(argv)
    return resolve_server_args(ServerArgs(**vars(ns)))


def build_app(args: ServerArgs, gc_freeze: bool = False, **app_kw):
    """(FastAPI app, engine) for resolved args; loads the weights. gc_freeze: freeze the start-up
    heap after the warm-up (server/gc_watch.py; the CLI's default, DDTREE_GC_FREEZE; off for
    servers built inside another process, e.g. the tests). With --dp-size N > 1 (or
    --dp-replica-process) the engine is a `DPEngine` over N replica processes
    (ddtree/server/dp/), started here, all of them ready."""
    from ddtree.server.api import create_app

    if args.dp_size > 1 or args.dp_replica_process:
        from ddtree.server.dp.launch import start_dp_engine

        aengine = start_dp_engine(args, gc_freeze=gc_freeze)
    else:
        aengine = build_engine(args, gc_freeze)
    return create_app(aengine, args, aengine.metrics, **app_kw), aengine


def draining_server(config, aengine, drain_timeout: float):
    """A uvicorn.Server whose signals drain with a deadline (see the module docstring)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self):
            super().__init__(config)
            self._timer: threading.Timer | None = None
            self._ended = False

        def handle_exit(self, sig: int, frame) -> None:
            # NOTE: uvicorn's own handler records the signal and re-raises it after the drain (death
            # by signal, status 143/130); a server that drained as asked exits 0 instead
            if self._ended:
                self.force_exit = True
                return
            self.should_exit = True
            if sig == signal.SIGTERM and self._timer is None and drain_timeout > 0:
                logger.info(
                    "SIGTERM: draining in-flight requests for up to %g s (send SIGTERM "
                    "again or SIGINT to end them now)",
                    drain_timeout,
                )
                self._timer = threading.Timer(drain_timeout, self.end_in_flight)
                self._timer.daemon = True
                self._timer.start()
            else:
                self.end_in_flight()

        def end_in_flight(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            if not self._ended:
                self._ended = True
                logger.info("ending in-flight requests: server is shutting down")
                aengine.fail_all()

    return DrainingServer()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = make_parser("ddtree serve").parse_args(argv)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()), format="[ddtree] %(message)s")
    try:
        args = resolve_server_args(ServerArgs(**vars(ns)))
        gc_freeze = gc_freeze_on()
        if weight_problems(args):  # serving needs the weights; planning did not
            raise ConfigError(weight_problems(args))
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: invalid configuration: {problem}", file=sys.stderr)
        return 2
    import uvicorn

    from ddtree.server.http import uvicorn_kwargs

    try:
        app, aengine = build_app(args, gc_freeze=gc_freeze)
    except ConfigError as e:  # found while starting: GPUs a --tp-size / --dp-size needs, ...
        for problem in e.problems:
            print(f"error: invalid configuration: {problem}", file=sys.stderr)
        return 2
    logger.info(
        "serving %s (%s) on http://%s:%d",
        args.served_model_name,
        args.speculative_algorithm,
        args.host,
        args.port,
    )
    # uvicorn's own graceful timeout is only a backstop: ended requests answer within a step
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        **uvicorn_kwargs(),
        timeout_graceful_shutdown=args.graceful_shutdown_timeout + 10,
    )
    try:
        draining_server(config, aengine, args.graceful_shutdown_timeout).run()
    finally:
        aengine.shutdown()  # after a forced exit the lifespan shutdown did not run
        aengine.engine.shutdown()  # the other tensor-parallel ranks, if any
    return 0
