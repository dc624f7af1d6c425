"""The device side of resolving ServerArgs: CPU threads, --tp-size / --dp-size placement, the
attention backend, CUDA graphs, and the dtype / context defaults a target's config gives."""

from __future__ import annotations

import logging
import os

from ddtree.config.args import (
    CPU_PARAMS_PER_THREAD,
    DTYPES,
    SHARED_GPU_FRACTION,
    ServerArgs,
)
from ddtree.engine.config import DEFAULT_CUDA_GRAPH_MAX_BS
from ddtree.models.configs import (
    DrafterConfig,
    TargetConfig,
    drafter_param_count,
    target_param_count,
)

logger = logging.getLogger("ddtree")


def triton_available() -> bool:
    """Whether `import triton` would succeed, found without importing it (that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def available_cores() -> int:
    """The cores this process may run on (its affinity mask; a container's CPU set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_cpu_threads(
    a: ServerArgs, t: TargetConfig | None, d: DrafterConfig | None, upd: dict, device: str, p
) -> None:
    """--cpu-threads as given; on the CPU by default OMP_NUM_THREADS, else by model size (see
    CPU_PARAMS_PER_THREAD), at most this process's share of the cores."""
    if a.cpu_threads is not None:
        if a.cpu_threads < 1:
            p.append(f"--cpu-threads {a.cpu_threads}: give at least 1 (or leave it out: automatic)")
        return
    if device != "cpu" or t is None:
        return
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        upd["cpu_threads"] = int(omp)
        logger.info("CPU threads are set to %d from OMP_NUM_THREADS.", int(omp))
        return
    params = target_param_count(t) + (drafter_param_count(d) if d is not None else 0)
    # every rank of every --dp-size replica is a process of its own (bad sizes are reported apart)
    share = max(1, available_cores() // max(a.tp_size * a.dp_size, 1))
    n = max(1, min(share, -(-params // CPU_PARAMS_PER_THREAD)))
    upd["cpu_threads"] = n
    logger.info(
        "CPU threads are set to %d (%.0fM parameters, %d cores per rank; --cpu-threads or "
        "OMP_NUM_THREADS to choose).",
        n,
        params / 1e6,
        share,
    )


def check_tp_devices(tp: int, device: str, p: list[str]) -> None:
    """Rank r runs on cuda:r (the GPU count is checked when the ranks start, so check-config can
    plan --tp-size 8 from any machine)."""
    if tp > 1 and device.startswith("cuda") and device != "cuda":
        p.append(f"--device {device}: with --tp-size {tp} pass --device cuda (rank r uses cuda:r)")


def check_dp(a: ServerArgs, device: str, p: list[str]) -> None:
    """--dp-size and its placement flags (the GPU count is checked when the replicas start, so
    check-config can plan --dp-size 8 from any machine)."""
    if a.dp_size == 1:
        if (a.base_gpu_id, a.gpu_id_step) != (0, 1):
            p.append(
                "--base-gpu-id / --gpu-id-step place --dp-size replicas; one engine runs on the "
                "first --tp-size visible GPUs: drop them and set CUDA_VISIBLE_DEVICES"
            )
        if a.load_balance_method != "round_robin":
            logger.warning(
                "--load-balance-method %s ignored: it dispatches between --dp-size replicas "
                "(--dp-size is 1)",
                a.load_balance_method,
            )
        return
    if a.dp_replica_process:
        p.append(
            f"--dp-replica-process: --dp-size {a.dp_size} always runs its engines in replica "
            "processes; drop it (it acts with --dp-size 1)"
        )
    if device.startswith("cuda") and device != "cuda":
        p.append(
            f"--device {device}: with --dp-size {a.dp_size} pass --device cuda (replicas are "
            "placed by --base-gpu-id / --gpu-id-step)"
        )
    if a.gpu_id_step == 0 and a.tp_size > 1:
        p.append(
            f"--gpu-id-step 0 with --tp-size {a.tp_size}: the ranks of one replica need "
            "distinct GPUs; pass --gpu-id-step 1"
        )
    if a.gpu_id_step == 0 and device != "cpu":
        total = a.dp_size * a.mem_fraction_static
        if total > SHARED_GPU_FRACTION:
            share = SHARED_GPU_FRACTION / a.dp_size
            p.append(
                f"--dp-size {a.dp_size} replicas share one GPU (--gpu-id-step 0), each taking "
                f"--mem-fraction-static {a.mem_fraction_static} of it ({total:.2f} in all); "
                f"pass --mem-fraction-static {int(share * 100) / 100:g} or less"
            )
    if a.load_balance_method == "cache_aware" and a.disable_radix_cache:
        p.append(
            "--load-balance-method cache_aware routes by the prefix cache, which "
            "--disable-radix-cache turns off; drop one of them (shortest_queue balances load alone)"
        )


def resolve_attention_backend(a: ServerArgs, upd: dict, device: str, p: list[str]) -> None:
    """auto -> the fast path of the device at hand: triton on cuda (its launcher dispatches the
    Gluon kernels on sm_90), the torch reference on the CPU or where triton is not installed."""
    if a.attention_backend == "triton" and not triton_available():
        p.append(
            "--attention-backend triton: triton is not installed; pip install triton (CUDA "
            "torch wheels bring it), or pass --attention-backend torch"
        )
    if a.attention_backend != "auto":
        return
    if device != "cuda":
        backend, why = "torch", "the reference, on the CPU"
    elif triton_available():
        backend, why = "triton", "cuda with triton installed"
    else:
        backend, why = "torch", "triton is not installed (pip install triton); graphs need it"
    upd["attention_backend"] = backend
    logger.info("Attention backend is set to %s (%s).", backend, why)


def resolve_cuda_graph(a: ServerArgs, upd: dict, device: str) -> None:
    if a.disable_cuda_graph:
        if a.cuda_graph_max_bs is not None:
            logger.warning("--cuda-graph-max-bs ignored: --disable-cuda-graph is set")
        return
    backend = upd.get("attention_backend", a.attention_backend)
    why = (
        "the device is cpu"
        if device != "cuda"
        else None
        if backend == "triton"
        else f"--attention-backend {backend} is not capturable; pass --attention-backend triton"
    )
    if why:
        upd["disable_cuda_graph"] = True
        logger.info("CUDA graphs are disabled: %s.", why)
        return
    running = upd.get("max_running_requests", a.max_running_requests)
    max_bs = min(a.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, running)
    if max_bs != a.cuda_graph_max_bs:
        upd["cuda_graph_max_bs"] = max_bs
        logger.info(
            "Cuda graph max bs is set to %d%s.",
            max_bs,
            " (--max-running-requests)"
            if a.cuda_graph_max_bs and a.cuda_graph_max_bs > running
            else "",
        )
    logger.info("CUDA graphs are enabled for verify and draft (batch sizes up to %d).", max_bs)


def resolve_target_defaults(
    a: ServerArgs, t: TargetConfig, d: DrafterConfig | None, upd: dict, device: str, p: list[str]
) -> None:
    if a.dtype == "auto" and device == "cpu":
        # CPU bf16 matmuls are slow and round differently for different batch shapes, so a tree verify
        # could flip a near-tie that plain decoding resolves the other way.
        upd["dtype"] = "float32"
        logger.info("Dtype is set to float32 on the CPU (pass --dtype to override).")
    elif a.dtype == "auto":
        dtype = t.dtype.removeprefix("torch.")
        if dtype not in DTYPES:
            logger.warning("Target config dtype %r is not supported; using bfloat16", t.dtype)
            dtype = "bfloat16"
        upd["dtype"] = dtype
        logger.info("Dtype is set to %s from the target model config.", dtype)
    dtype = upd.get("dtype", a.dtype)
    if a.kv_cache_dtype == "auto":
        upd["kv_cache_dtype"] = dtype
    elif a.kv_cache_dtype != dtype:
        p.append(
            f"--kv-cache-dtype {a.kv_cache_dtype} differs from --dtype {dtype}: a separate KV "
            f"cache dtype is not implemented yet; drop --kv-cache-dtype or pass "
            f"--kv-cache-dtype {dtype}"
        )
    ctx = a.context_length
    if ctx is None:
        ctx = upd["context_length"] = t.max_position_embeddings
        logger.info("Context length is set to %d from the target model config.", ctx)
    elif ctx > t.max_position_embeddings:
        logger.warning(
            "--context-length %d exceeds the target's max_position_embeddings %d; outputs past it are "
            "unreliable",
            ctx,
            t.max_position_embeddings,
        )
    if d is not None and ctx > d.max_position_embeddings:
        logger.warning(
            "--context-length %d exceeds the drafter's max_position_embeddings %d; acceptance may drop "
            "on long requests",
            ctx,
            d.max_position_embeddings,
        )
