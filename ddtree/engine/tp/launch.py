"""Start a tensor-parallel group from `--tp-size`: one process per rank, started by ddtree itself.

Rank 0 is the calling process (the server or the offline `LLM`); ranks 1..N-1 are
`torch.multiprocessing` spawn children running `run_rank`. All join one torch.distributed group
over localhost TCP (NCCL on GPUs, rank r on cuda:r; gloo on the CPU) plus a gloo control group. Model
collectives time out after DDTREE_TP_TIMEOUT_S.

Failure is loud, never a hang: rank 0's `RankWatch` polls the children; a child that exits makes
`TPRank.problem()` name it (the server's /health answers 503 with it, the next step raises
`RankFailure`). On the CPU (gloo) a collective with a dead peer fails at once; NCCL would wait for
its timeout, so with NCCL the watch ends rank 0 with an error naming the rank instead. Children
leave when rank 0's process goes (they watch their parent) or its sockets close.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from ddtree.engine.tp.rank import CONTROL_TIMEOUT, TPRank, collective_timeout
from ddtree.models.configs import ConfigError

logger = logging.getLogger("ddtree")

POLL_S = 0.2
CASCADE_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join_group(rank: int, size: int, port: int, device: torch.device, watch=None) -> TPRank:
    """init_process_group for this rank (+ the control group); blocks until every rank joined."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=collective_timeout(),
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPRank(rank, size, control, watch)


class RankWatch:
    """Rank 0's view of the other ranks' processes: `failure` names the first one that exited."""

    def __init__(self, procs: dict, exit_on_failure: bool):
        self.procs, self.exit_on_failure = procs, exit_on_failure
        self.failure: str | None = None
        self.closing = False  # set by rank 0's shutdown: exits from then on are expected
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddtree-tp-watch", daemon=True)
        self._thread.start()

    def poll(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        while self.failure is None and not self.closing:
            if any(p.exitcode is not None for p in self.procs.values()):
                # the others follow within moments (their collectives fail): name all of them,
                # ranks ended by a signal first (a kill is the cause, an exit code 1 its echo)
                time.sleep(CASCADE_S)
                dead = [(r, p) for r, p in self.procs.items() if p.exitcode is not None]
                dead.sort(key=lambda rp: (rp[1].exitcode >= 0, rp[0]))
                self.failure = "; ".join(
                    f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                    for r, p in dead
                )
                logger.error("%s; the engine cannot continue", self.failure)
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(min(POLL_S, wait_s))

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()
            if self.failure is not None:
                if self.exit_on_failure:  # NCCL: a collective with a dead peer would only time out
                    os._exit(1)
                return

    def stop(self, timeout: float = 10.0) -> None:
        """Wait `timeout` for the ranks to leave, then end the ones still running."""
        self.closing = True
        self._stop.set()
        for p in self.procs.values():
            p.join(timeout)
            if p.exitcode is None:
                p.terminate()
                p.join(max(timeout, 5.0))


def start_ranks(args, device: torch.device, engine_cls) -> TPRank:
    """Rank 0: spawn ranks 1..tp-1, each building an `engine_cls` (the LLMEngine: handed down so
    this package never imports the engine that uses it), and join them."""
    import torch.multiprocessing as mp

    size, port = args.tp_size, free_port()
    if dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel engine is already running in this process (one per process); "
            "call its LLMEngine.shutdown() first"
        )
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(
            f"--tp-size {size} needs {size} GPUs, {torch.cuda.device_count()} visible; lower "
            "--tp-size or set CUDA_VISIBLE_DEVICES"
        )
    ctx = mp.get_context("spawn")
    procs = {}
    for rank in range(1, size):
        p = ctx.Process(
            target=run_rank,
            args=(rank, size, port, args, torch.get_num_threads(), engine_cls),
            name=f"ddtree-tp-rank{rank}",
            daemon=True,
        )
        p.start()
        procs[rank] = p
    watch = RankWatch(procs, exit_on_failure=device.type == "cuda")
    pids = [p.pid for p in procs.values()]
    logger.info("tensor parallel: started ranks 1..%d (pids %s)", size - 1, pids)
    try:
        return join_group(0, size, port, device, watch)
    except Exception:
        watch.stop(timeout=1.0)
        raise


def _leave_with_parent(parent: int) -> None:
    """A rank whose rank 0 process is gone (killed: no shutdown message) exits instead of waiting."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def run_rank(rank: int, size: int, port: int, args, threads: int, engine_cls) -> None:
    """Ranks 1..N-1: the same engine as rank 0, stepping whenever rank 0 steps (rank.py)."""
    logging.basicConfig(level=logging.WARNING, format=f"[ddtree rank {rank}] %(message)s")
    threading.Thread(target=_leave_with_parent, args=(os.getppid(),), daemon=True).start()
    if threads:
        torch.set_num_threads(threads)
    from ddtree.engine.setup import resolve_device
    from ddtree.engine.tp.rank import Shutdown

    tp = join_group(rank, size, port, rank_device(resolve_device(args.device), rank))
    try:
        engine = engine_cls(args, tp_rank=tp)
        while True:
            engine.step()
    except Shutdown:
        pass
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        logging.shutdown()
        os._exit(1)  # a collective may be half done: leave without tearing the group down
    finally:
        tp.closed = True  # rank 0 ended the group; nothing to tell anyone
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
