"""One rank's side of tensor parallelism: its groups, the control channel from rank 0, lockstep checks.

Every rank runs the whole engine (scheduler, decoder, emitter) on identical inputs. Rank 0 owns the
requests: at the top of each step it broadcasts, on a gloo control group, the requests added and
aborted since the previous step (`Message`), then every rank runs the same `step()`, whose forwards
meet in the model's collectives.

Batches, trees, accept walks and samples are computed on every rank, not broadcast: the scheduler is a
pure function of the command stream and of the tokens emitted, and every token comes from all-gathered
logits (bit-identical on every rank: `ddtree.models.parallel`) sampled with noise keyed by (seed,
position) (engine/round/sampler.py; the seeds come from the same `--random-seed` stream, consumed in
the same add order).
Each rank already holds those logits, so computing everywhere costs nothing, where broadcasting each
round's tree and accepted tokens would add a collective and a host sync to every round. The lockstep is
checked, not assumed: each message carries rank 0's digest of its requests (rid, tokens so far, last
token, cached length) as of the step's start, and a rank whose own digest differs once it applied the
commands stops with an error naming the step.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ddtree import envs
from ddtree.models.parallel import TPGroup

logger = logging.getLogger("ddtree")

# Followers wait on the control group while the server is idle, for as long as it stays idle.
CONTROL_TIMEOUT = timedelta(days=7)


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or fell out of lockstep; the engine cannot continue."""


class Shutdown(Exception):
    """Rank 0 ended the group (followers leave their loop)."""


@dataclass
class Message:
    commands: list = field(default_factory=list)  # ("add", ids, params, rid) / ("abort", rid)
    digest: int = 0  # rank 0's `state_digest` with these commands applied
    stop: bool = False


def collective_timeout() -> timedelta:
    return timedelta(seconds=float(envs.TP_TIMEOUT_S.get()))


def state_digest(engine) -> int:
    """What every rank must agree on before a step: each request's id, tokens, last token, cache."""
    rows = [
        (rid, r.num_output_tokens, r.output_ids[-1] if r.output_ids else -1, r.kv_len)
        for rid, r in engine.requests.items()
    ]
    return zlib.crc32(repr(rows).encode())


class TPRank:
    """This process's rank: `group` (for the model's collectives) and the control channel. `watch` (rank
    0 only) follows the other ranks' processes."""

    def __init__(self, rank: int, size: int, control, watch=None):
        self.group = TPGroup(rank, size, dist.group.WORLD)
        self.control, self.watch = control, watch
        self.pending: list = []
        self.steps = 0
        self.closed = False
        # set once every rank built its engine (`started`): from then on all of them wait at `sync`,
        # so a stop message reaches them; before, rank 0 can only end their processes
        self.ready = False

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def is_driver(self) -> bool:
        return self.group.rank == 0

    def started(self) -> None:
        """End of every rank's engine construction: a barrier that names a rank that never comes."""
        dist.monitored_barrier(group=self.control, timeout=collective_timeout())
        self.ready = True

    def problem(self) -> str | None:
        """Why the group cannot serve (a rank died), or None."""
        return None if self.watch is None else self.watch.failure

    def check(self) -> None:
        if self.problem():
            raise RankFailure(self.problem())

    def publish(self, command: tuple) -> None:
        """Rank 0: a command for the other ranks, sent with the next step (followers: nothing). A new
        request is refused once a rank is gone; an abort never raises (it runs while failing)."""
        if self.is_driver:
            if command[0] == "add":
                self.check()
            self.pending.append(command)

    def sync(self, engine) -> None:
        """The top of every step: rank 0 sends its commands, the others apply them."""
        self.steps += 1
        if self.is_driver:
            self.check()
            msg, self.pending = Message(self.pending, state_digest(engine)), []
            self._broadcast(msg)
            return
        msg = self._broadcast(None)
        if msg.stop:
            raise Shutdown
        for cmd in msg.commands:
            if cmd[0] == "add":
                engine.add_request(cmd[1], cmd[2], rid=cmd[3])
            else:
                engine.abort(cmd[1])
        if msg.digest != state_digest(engine):
            raise RankFailure(
                f"tensor-parallel rank {self.rank} diverged from rank 0 before step {self.steps}"
            )

    def _broadcast(self, msg: Message | None) -> Message:
        box = [msg]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except Exception as e:  # a peer's socket closed: name the rank when the watch knows it
            if self.watch is not None:
                self.watch.poll(wait_s=2.0)
                if self.watch.failure:
                    raise RankFailure(self.watch.failure) from e
            raise RankFailure(f"tensor-parallel rank {self.rank}: control broadcast failed: {e}")
        return box[0]

    def close(self) -> None:
        """Rank 0: stop the other ranks and wait for them (end them where they cannot hear: before
        `started`, or once a rank is gone); every rank: leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self.watch is not None:
            self.watch.closing = True
        orderly = self.is_driver and self.ready and self.problem() is None
        if orderly:
            try:
                self._broadcast(Message(stop=True))
            except RankFailure:
                orderly = False
                logger.warning("tensor-parallel: a rank was already gone at shutdown")
        elif self.is_driver:
            logger.warning("tensor-parallel: ending ranks 1..%d", self.group.size - 1)
        if self.watch is not None:
            self.watch.stop(timeout=10.0 if orderly else 0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
