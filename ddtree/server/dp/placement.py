"""Where `--dp-size` replicas run: the GPUs of each, from --tp-size, --base-gpu-id and --gpu-id-step
(SGLang's rule: replica i's rank r on GPU base + (i * tp + r) * step, an index among the visible
GPUs). Torch-free, so `ddtree check-config` prints the placement from any machine; the replica
process sees only its own GPUs (CUDA_VISIBLE_DEVICES), so inside it rank r is `cuda:r` as in a
one-engine server."""

from __future__ import annotations

import os

from ddtree.configs import ConfigError


def replica_gpus(dp: int, tp: int, base: int = 0, step: int = 1) -> list[list[int]]:
    """GPU indices (among the visible ones) of each replica's ranks."""
    return [[base + (i * tp + r) * step for r in range(tp)] for i in range(dp)]


def placement(args) -> list[list[int]] | None:
    """Each replica's GPU indices, or None on the CPU."""
    if args.device == "cpu":
        return None
    return replica_gpus(args.dp_size, args.tp_size, args.base_gpu_id, args.gpu_id_step)


def shared(gpus: list[list[int]] | None) -> bool:
    """Whether some replicas share a GPU (--gpu-id-step 0)."""
    if not gpus:
        return False
    flat = [g for ranks in gpus for g in ranks]
    return len(set(flat)) < len(flat)


def visible_devices(n_visible: int) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of this process's GPUs, in index order."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or not env.strip():
        return [str(i) for i in range(n_visible)]
    return [d.strip() for d in env.split(",") if d.strip()][:n_visible]


def check_gpus(gpus: list[list[int]], n_visible: int, args) -> None:
    """Refuse a placement past the visible GPUs, naming the fix."""
    need = max(g for ranks in gpus for g in ranks) + 1
    if need > n_visible:
        raise ConfigError(
            f"--dp-size {args.dp_size} x --tp-size {args.tp_size} (--base-gpu-id "
            f"{args.base_gpu_id}, --gpu-id-step {args.gpu_id_step}) needs GPU index {need - 1}, "
            f"{n_visible} visible; lower --dp-size, set CUDA_VISIBLE_DEVICES, or share a GPU "
            "with --gpu-id-step 0 and a --mem-fraction-static share"
        )


def describe(gpus: list[list[int]] | None, dp: int) -> list[str]:
    """One line per replica: its GPUs (or the CPU)."""
    if gpus is None:
        return [f"replica {i}: cpu" for i in range(dp)]
    return [f"replica {i}: GPU{'s' if len(g) > 1 else ''} {_span(g)}" for i, g in enumerate(gpus)]


def _span(ids: list[int]) -> str:
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))
