"""One `--dp-size` replica: the server's engine loop in a process of its own.

The replica runs what a one-engine server runs inside its HTTP process (`build_engine`: the
LLMEngine, its metrics, the AsyncEngine's engine thread with its warm-up, overlap and fault
handling), with the HTTP side replaced by the pipe to the HTTP process (`messages.py`): the main
thread's event loop admits requests (`AsyncEngine.submit` with the dispatcher's rid), and each
publish's Deltas, which the engine thread hands to this loop in one call, leave as one message.
So the engine thread shares its GIL with this thin loop only, not with the HTTP server.

The replica ignores SIGINT and SIGTERM (a Ctrl-C or a `systemctl stop` reaching the whole process
group must not end requests the server is draining): it leaves on STOP, when the HTTP process
goes (its pipe closes, or it is no longer the parent), or when its engine thread has died (so the
dispatcher fails what it held instead of waiting on it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time

from ddtree.server.dp import messages as m

logger = logging.getLogger("ddtree")

PARENT_POLL_S = 0.5


def _leave_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def run_replica(rank: int, args, conn, cuda_devices: str | None, opts: dict) -> None:
    """The process's entry: opts = switch_interval_s, gc_freeze (CPU threads: --cpu-threads,
    resolved for every replica's ranks, which the engine applies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cuda_devices is not None:  # before anything initialises CUDA: rank r is then cuda:r
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format=f"[ddtree dp{rank}] %(message)s")
    threading.Thread(target=_leave_with_parent, args=(os.getppid(),), daemon=True).start()
    if opts.get("switch_interval_s"):
        sys.setswitchinterval(opts["switch_interval_s"])
    try:
        replica = Replica(rank, args, conn, opts.get("gc_freeze", False))
    except BaseException as e:  # noqa: BLE001 - reported to the HTTP process, which stops the start
        problems = getattr(e, "problems", None)  # a ConfigError's, each naming the fix
        message = "; ".join(problems) if problems else f"{type(e).__name__}: {e}"
        logger.exception("replica %d could not start", rank)
        try:
            conn.send((m.FAILED, message, problems is not None))
        finally:
            logging.shutdown()
            os._exit(1)
    replica.run()
    logging.shutdown()
    os._exit(replica.exit_code)  # no interpreter teardown: the engine thread and CUDA are done


class _Sink:
    """A stream's queue as AsyncEngine sees it: its Deltas join the replica's next DELTAS message."""

    __slots__ = ("rid", "replica")

    def __init__(self, rid: str, replica: Replica):
        self.rid, self.replica = rid, replica

    def put_nowait(self, delta) -> None:
        self.replica.outgoing(self.rid, delta)


class Replica:
    def __init__(self, rank: int, args, conn, gc_freeze: bool):
        from ddtree.server.build import build_engine

        self.rank, self.conn = rank, conn
        from ddtree.server.structured import GrammarCompiler

        self.aengine = build_engine(args, gc_freeze)
        self.engine = self.aengine.engine
        self.grammars = GrammarCompiler(self.engine)
        self._send_lock = threading.Lock()
        self._pending: list = []  # (rid, Delta) not sent yet
        self._tasks: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Event | None = None
        self.exit_code = 0

    def send(self, msg: tuple) -> None:
        """To the HTTP process; once it is gone (its pipe closed) the replica stops instead."""
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                if self.stopping is not None:
                    self.stopping.set()

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
        self.aengine.start()
        stats = self.engine.stats()
        info = {
            "pid": os.getpid(),
            "max_context": self.engine.max_context,
            "page_size": stats.page_size,
            "kv_pages_total": stats.kv_pages_total,
            "prefix_cache": stats.prefix_cache is not None,
            "device": _device_name(self.engine.device),
            "vocab_size": self.engine.vocab_size,
            "eos_ids": tuple(self.engine.eos_ids),
        }
        self.send((m.READY, info))
        threading.Thread(target=self._read, name="ddtree-dp-read", daemon=True).start()
        beat = asyncio.ensure_future(self._heartbeat())
        await self.stopping.wait()
        beat.cancel()
        self.aengine.fail_all()  # none should be left after a drain; a lost parent leaves some
        self.aengine.shutdown()  # the engine thread ends every request still in flight
        self.engine.shutdown()  # the replica's own tensor-parallel ranks, if any
        await asyncio.sleep(0)  # the engine thread's last hand-off to this loop
        self._flush()
        self.send((m.STOPPED,))

    def _read(self) -> None:
        """The pipe's reader thread: each message to the loop, in order; EOF = the parent left."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.loop.call_soon_threadsafe(self.stopping.set)
                return
            self.loop.call_soon_threadsafe(self._on_message, msg)
            if msg[0] == m.STOP:
                return

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == m.ADD:
            self._spawn(self._add(*msg[1:]))
        elif kind == m.ABORT:
            self.aengine.abort(msg[1])
        elif kind == m.CALL:
            self._spawn(self._call(msg[1], msg[2]))
        elif kind == m.FAIL_ALL:
            self.aengine.fail_all(msg[1])
        elif kind == m.STOP:
            self.stopping.set()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, rid: str, ids: list[int], params, arrival: float) -> None:
        from ddtree.server.async_engine import EngineUnavailable
        from ddtree.server.protocol import APIError

        try:
            # the HTTP process validated the grammar; compiled here too, off the engine thread,
            # its admission is a cache hit (as in a one-engine server); the HTTP process bounded
            # the client's compiles, so each request counts as its own client here
            await self.grammars.compile(params.grammar, client=rid)
        except APIError as e:
            self.send((m.REFUSED, rid, "invalid", e.message))
            return
        try:
            await self.aengine.submit(
                lambda e: (ids, params), arrival, rid=rid, sink=_Sink(rid, self)
            )
        except EngineUnavailable as e:  # back-pressure (retry_after) or a replica that is done
            kind = "unavailable" if e.retry_after is None else "busy"
            self.send((m.REFUSED, rid, kind, str(e)))
        except ValueError as e:  # the engine's own admission checks
            self.send((m.REFUSED, rid, "invalid", str(e)))
        except Exception as e:  # noqa: BLE001 - the request fails, the replica goes on
            logger.exception("admitting %s failed", rid)
            self.send((m.REFUSED, rid, "error", f"{type(e).__name__}: {e}"))
        else:
            self.send((m.ADDED, rid))

    async def _call(self, call_id: int, what: str) -> None:
        result = None
        try:
            if what == m.INFO:
                result = await self.aengine.pool_snapshot()
            elif what == m.METRICS and self.aengine.metrics is not None:
                result = await self.aengine.render_metrics()
        except Exception:  # noqa: BLE001 - the caller reads None as "no answer"
            logger.exception("%s failed", what)
        self.send((m.REPLY, call_id, result))

    def outgoing(self, rid: str, delta) -> None:
        """A Delta for the HTTP process (on this loop); sent with the rest of this hand-off."""
        if not self._pending:
            self.loop.call_soon(self._flush)
        self._pending.append((rid, delta))

    def _flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self.send((m.DELTAS, batch))

    async def _heartbeat(self) -> None:
        while True:
            if not self.aengine.alive:  # the engine thread died: leave, so its requests fail
                logger.error("replica %d: the engine thread ended; leaving", self.rank)
                self.exit_code = 1
                self.stopping.set()
                return
            self.send((m.STATUS, self.aengine.health_problem()))
            await asyncio.sleep(m.HEARTBEAT_S)


def _device_name(device) -> str:
    """The device with its index ("cuda:0": under its CUDA_VISIBLE_DEVICES a replica's first GPU is
    always 0), where the engine names a bare "cuda"."""
    import torch

    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)
