"""The HTTP process's side of one `--dp-size` replica: its process and pipe, the streams it holds,
its health. Everything but the pipe's reader thread runs on the server's event loop; the reader
hands each message to the loop whole (one `call_soon_threadsafe` per message: per replica, one per
engine step that advanced a stream) and keeps the replica's health current even while the loop
is busy.

A replica that dies (its pipe closes) fails the requests it held with 503 `replica_unavailable`
and only those; a request it had not yet admitted (`add` still waiting) raises `ReplicaGone`, and
the dispatcher sends it elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import threading
import time

from ddtree.server.async_engine import Delta, EngineUnavailable, Stream
from ddtree.server.dp import messages as m

logger = logging.getLogger("ddtree")

JOIN_S = 5.0  # how long a replica that closed its pipe gets to exit before it is reported


class ReplicaGone(Exception):
    """The replica died before it admitted the request (the request can go to another one)."""


class ReplicaBusy(Exception):
    """The replica's queue is full (--max-queued-requests): another one may take the request."""


def exit_text(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ReplicaClient:
    def __init__(self, rank: int, proc, conn, gpus: list[int] | None, on_finish):
        self.rank, self.proc, self.conn, self.gpus = rank, proc, conn, gpus
        self.on_finish = on_finish  # (client, rid, prompt + output ids or None), on the loop
        self.keep_ids = False  # the policy learns from finished requests' tokens (cache_aware)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.info: dict | None = None  # the READY message: pid, max_context, pages, ...
        self.ready = threading.Event()  # READY, or the process is gone
        self.start_error: str | None = None
        self.start_config_error = False  # start_error is a ConfigError's problems
        self.reported: str | None = "starting"  # the latest STATUS: its own /health problem
        self.last_seen = time.monotonic()
        self.failure: str | None = None  # why it is gone, once it is
        self.closing = False  # asked to stop: its exit is no failure
        self.dispatched = 0
        self.streams: dict[str, Stream] = {}
        self._ids: dict[str, list[int]] = {}
        self._adds: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"ddtree-dp{rank}", daemon=True)
        self._reader.start()

    @property
    def name(self) -> str:
        where = f", GPU {','.join(map(str, self.gpus))}" if self.gpus else ""
        return f"replica {self.rank} (pid {self.proc.pid}{where})"

    @property
    def page_size(self) -> int:
        return self.info["page_size"]

    @property
    def load(self) -> int:
        """Requests in flight: dispatched and not finished."""
        return len(self.streams)

    def problem(self) -> str | None:
        """Why this replica takes no new request now, or None."""
        if self.failure is not None:
            return self.failure
        if self.info is None:
            return f"{self.name}: starting"
        silent = time.monotonic() - self.last_seen
        if silent > m.STALE_S:
            return f"{self.name}: no word for {silent:.0f} s"
        if self.reported is not None:
            return f"{self.name}: {self.reported}"
        return None

    def send(self, msg: tuple) -> bool:
        with self._send_lock:
            try:
                self.conn.send(msg)
                return True
            except (OSError, ValueError):  # the pipe is closed: the reader reports why
                return False

    # ---- on the event loop ------------------------------------------------------------------------
    async def add(self, st: Stream, ids: list[int], params, arrival: float) -> None:
        """Admit a request; returns once the replica did. Raises ReplicaGone (it died first),
        ReplicaBusy (its queue is full), EngineUnavailable, ValueError (the engine's admission
        checks) or RuntimeError."""
        if self.failure is not None:
            raise ReplicaGone(self.failure)
        fut = self.loop.create_future()
        self._adds[st.rid] = fut
        self.streams[st.rid] = st  # its first Deltas may come before the answer
        if self.keep_ids:
            self._ids[st.rid] = list(ids)
        try:
            if not self.send((m.ADD, st.rid, ids, params, arrival)):
                raise ReplicaGone(f"{self.name}: its pipe is closed")
            await fut
        except asyncio.CancelledError:
            self.abort(st.rid)  # admitted or about to be: nobody will read it
            raise
        except BaseException:
            self.streams.pop(st.rid, None)
            self._ids.pop(st.rid, None)
            raise
        finally:
            self._adds.pop(st.rid, None)
        self.dispatched += 1

    def abort(self, rid: str) -> None:
        if self.streams.pop(rid, None) is not None:
            self._ids.pop(rid, None)
            self.send((m.ABORT, rid))

    async def call(self, what: str, timeout: float):
        """The replica's answer to INFO / METRICS, or None (gone, failed or too slow)."""
        if self.failure is not None:
            return None
        cid = next(self._call_ids)
        fut = self._calls[cid] = self.loop.create_future()
        try:
            if not self.send((m.CALL, cid, what)):
                return None
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            return None
        finally:
            self._calls.pop(cid, None)

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == m.DELTAS:
            for rid, d in msg[1]:
                st = self.streams.get(rid)
                if st is None:  # aborted meanwhile
                    continue
                ids = self._ids.get(rid)
                if ids is not None:
                    ids += d.token_ids
                st.queue.put_nowait(d)
                if d.finish_reason is not None or d.error is not None:
                    del self.streams[rid]
                    ids = self._ids.pop(rid, None)
                    self.on_finish(self, rid, ids if d.error is None else None)
        elif kind == m.ADDED:
            _resolve(self._adds.get(msg[1]), None)
        elif kind == m.REFUSED:
            _, rid, why, text = msg
            err = {
                "busy": ReplicaBusy,
                "unavailable": EngineUnavailable,
                "invalid": ValueError,
            }.get(why, RuntimeError)
            fut = self._adds.get(rid)
            if fut is not None and not fut.done():
                fut.set_exception(err(text))
        elif kind == m.REPLY:
            _resolve(self._calls.get(msg[1]), msg[2])

    def _fail_held(self) -> None:
        """The replica is gone: every request it held ends with 503, adds in flight go elsewhere."""
        lost = f"{self.failure}; the request was lost with it (other replicas keep serving)"
        for rid, st in list(self.streams.items()):
            fut = self._adds.get(rid)
            if fut is not None:  # not admitted: the dispatcher tries another replica
                if not fut.done():
                    fut.set_exception(ReplicaGone(self.failure))
                continue
            err = Delta(
                error=lost,
                error_status=503,
                error_code="replica_unavailable",
                finish_reason="abort",
                prompt_tokens=st.prompt_tokens,
            )
            st.queue.put_nowait(err)
            self.on_finish(self, rid, None)
        self.streams.clear()
        self._ids.clear()
        for fut in self._calls.values():
            _resolve(fut, None)

    # ---- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            self.last_seen = time.monotonic()
            kind = msg[0]
            if kind == m.STATUS:
                self.reported = msg[1]
            elif kind == m.READY:
                self.info = msg[1]
                self.ready.set()
            elif kind == m.FAILED:
                self.start_error, self.start_config_error = msg[1], msg[2]
            elif kind != m.STOPPED and self.loop is not None:
                self.loop.call_soon_threadsafe(self._on_message, msg)
        self.proc.join(JOIN_S)
        code = self.proc.exitcode
        if self.closing and code == 0:
            self.failure = f"{self.name}: stopped"
        else:
            self.failure = f"{self.name} {exit_text(code)}"
            if self.start_error:
                self.failure += f": {self.start_error}"
            if not self.closing and self.info is not None:
                logger.error("%s; the other replicas go on serving", self.failure)
        self.ready.set()  # a start waiting for it sees the failure
        loop = self.loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._fail_held)
            except RuntimeError:  # the server's loop is closed: nobody is waiting
                pass

    def stop(self) -> None:
        """Ask the replica to leave (after the server drained)."""
        self.closing = True
        self.send((m.STOP,))

    def join(self, timeout: float) -> None:
        """Wait for the process (its reader thread reaps it); kill it if it does not leave in
        time (a replica ignores SIGTERM)."""
        self._reader.join(timeout)
        if self._reader.is_alive() or self.proc.exitcode is None:
            logger.warning("%s did not stop within %g s; killing it", self.name, timeout)
            self.proc.kill()
            self._reader.join(JOIN_S + 1.0)


def _resolve(fut: asyncio.Future | None, value) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)
