"""Ranks 1..N-1: the same engine as rank 0, stepping whenever rank 0 steps (see `rank.py`)."""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

logger = logging.getLogger("ddtree")


def _leave_with_parent(parent: int) -> None:
    """A rank whose rank 0 process is gone (killed: no shutdown message) exits instead of waiting."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def run_rank(rank: int, size: int, port: int, args, threads: int) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[ddtree rank {rank}] %(message)s")
    threading.Thread(target=_leave_with_parent, args=(os.getppid(),), daemon=True).start()
    if threads:
        torch.set_num_threads(threads)
    from ddtree.engine.engine import LLMEngine
    from ddtree.engine.setup import resolve_device
    from ddtree.engine.tp.launch import join_group, rank_device
    from ddtree.engine.tp.rank import Shutdown

    tp = join_group(rank, size, port, rank_device(resolve_device(args.device), rank))
    try:
        engine = LLMEngine(args, tp_rank=tp)
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
