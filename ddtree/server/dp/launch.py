"""Start a `--dp-size` server's replicas: one process each (`replica.run_replica`), on the
GPUs `memory_plan.placement` gives it (CUDA_VISIBLE_DEVICES; inside, its --tp-size ranks start as in a
one-engine server), all loading, profiling their budget costs and warming up in parallel; replicas
that share a GPU (--gpu-id-step 0) start one after another, so that none times its startup
profile while another loads or profiles on the same device (the profile is cached per device
kind, so the later ones read the first one's). Returns once every replica built its engine."""

from __future__ import annotations

import dataclasses
import logging
import sys

from ddtree.config.memory_plan import describe_placement, placement, shared
from ddtree.models.configs import ConfigError
from ddtree.server.dp.client import ReplicaClient
from ddtree.server.dp.engine import DPEngine, Frontend, _kill
from ddtree.server.dp.placement import check_gpus, visible_devices

logger = logging.getLogger("ddtree")


def start_dp_engine(args, gc_freeze: bool = False) -> DPEngine:
    import multiprocessing as mp

    from ddtree.server.dp.replica import run_replica

    gpus = placement(args)
    cuda = [None] * args.dp_size
    if gpus is not None:
        import torch

        n = torch.cuda.device_count()
        check_gpus(gpus, n, args)
        visible = visible_devices(n)
        cuda = [",".join(visible[g] for g in ranks) for ranks in gpus]
    opts = {
        "gc_freeze": gc_freeze,
        "switch_interval_s": sys.getswitchinterval(),
    }
    one = dataclasses.replace(
        args, dp_size=1, dp_replica_process=False, base_gpu_id=0, gpu_id_step=1
    )
    if gpus is None:  # CPU: one clean process imports torch and the engine once, each replica
        # is a fork of it (spawn imports them again per replica: seconds each)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "ddtree.engine.engine", "ddtree.server.launch"])
    else:  # GPUs: a fresh interpreter each, so no import can have touched CUDA before the fork
        ctx = mp.get_context("spawn")
    clients: list[ReplicaClient] = []
    logger.info(
        "data parallel: starting %d replicas (%s)",
        args.dp_size,
        "; ".join(describe_placement(gpus, args.dp_size)),
    )
    try:
        for i in range(args.dp_size):
            ours, theirs = ctx.Pipe()
            # not a daemon: a replica starts its own --tp-size ranks
            proc = ctx.Process(
                target=run_replica, args=(i, one, theirs, cuda[i], opts), name=f"ddtree-dp{i}"
            )
            proc.start()
            theirs.close()
            clients.append(ReplicaClient(i, proc, ours, None if gpus is None else gpus[i], None))
            if shared(gpus):
                _wait_ready(clients[-1])
        # this process's own imports and tokenizer, while the replicas load
        from ddtree.engine.setup import load_tokenizer
        from ddtree.server import api  # noqa: F401 - imported here to overlap the replicas' start

        tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        for c in clients:
            _wait_ready(c)
        contexts = {c.info["max_context"] for c in clients}
        if len(contexts) != 1:
            raise RuntimeError(f"replicas planned different context lengths {sorted(contexts)}")
    except BaseException:
        _kill(clients)
        raise
    metrics = None
    if args.enable_metrics:
        from ddtree.server.dp.metrics import DPMetrics

        metrics = DPMetrics()
    logger.info(
        "data parallel: %d replicas up (pids %s), --load-balance-method %s",
        args.dp_size,
        ", ".join(str(c.proc.pid) for c in clients),
        args.load_balance_method,
    )
    info = clients[0].info
    frontend = Frontend(tokenizer, contexts.pop(), info["vocab_size"], info["eos_ids"])
    return DPEngine(args, clients, frontend, metrics)


def _wait_ready(c: ReplicaClient) -> None:
    c.ready.wait()
    if c.info is None:
        problem = c.failure or f"{c.name} did not start"
        raise ConfigError([problem]) if c.start_config_error else RuntimeError(problem)
