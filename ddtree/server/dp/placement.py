"""Where `--dp-size` replicas run, at start-up: the visible GPUs behind the placement
(`memory_plan.placement`: SGLang's rule, replica i's rank r on GPU base + (i * tp + r) * step, an
index among the visible GPUs; torch-free, so `ddtree check-config` prints it from any machine).
The replica process sees only its own GPUs (CUDA_VISIBLE_DEVICES), so inside it rank r is `cuda:r`
as in a one-engine server."""

from __future__ import annotations

import os

from ddtree.models.configs import ConfigError


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
