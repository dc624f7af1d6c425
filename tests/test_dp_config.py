"""--dp-size's flags before anything loads: the checks in resolve_server_args, the GPU placement,
`ddtree check-config --dp-size N` (the replicas, their GPUs, and the tp-vs-dp trade when the model
fits one GPU), the offline LLM refusing it, and `ddtree serve` refusing GPUs it lacks (~10 s)."""

from __future__ import annotations

import os

import pytest
import torch
from config_fixtures import dense_pair, hybrid_pair

from ddtree.config import ServerArgs, prepare_server_args, resolve_server_args
from ddtree.config.check_config import main as check_config
from ddtree.config.memory_plan import describe_placement, replica_gpus, shared
from ddtree.models.configs import ConfigError
from ddtree.server.dp.placement import check_gpus


def argv(pair, *extra):
    target, drafter = pair
    return [
        "--model-path",
        target,
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        drafter,
        "--device",
        "cuda",
        *extra,
    ]


def problems(pair, *extra) -> str:
    with pytest.raises(ConfigError) as e:
        prepare_server_args(argv(pair, *extra))
    return "\n".join(e.value.problems)


def test_dp_flags_resolve(tmp_path):
    a = prepare_server_args(argv(dense_pair(tmp_path), "--dp-size", "8", "--tp", "1"))
    assert (a.dp_size, a.load_balance_method, a.base_gpu_id, a.gpu_id_step) == (
        8,
        "round_robin",
        0,
        1,
    )
    a = prepare_server_args(
        argv(dense_pair(tmp_path), "--dp", "2", "--load-balance-method", "cache_aware")
    )
    assert (a.dp_size, a.load_balance_method) == (2, "cache_aware")


def test_dp_flags_that_cannot_act_are_refused(tmp_path):
    pair = dense_pair(tmp_path)
    assert "set CUDA_VISIBLE_DEVICES" in problems(pair, "--base-gpu-id", "2")
    assert "distinct GPUs" in problems(
        pair, "--dp-size", "2", "--tp-size", "2", "--gpu-id-step", "0"
    )
    shared_gpu = problems(pair, "--dp-size", "2", "--gpu-id-step", "0")  # 2 x 0.85 of one GPU
    assert "1.70 in all" in shared_gpu and "--mem-fraction-static 0.45 or less" in shared_gpu
    cache = problems(
        pair, "--dp-size", "2", "--load-balance-method", "cache_aware", "--disable-radix-cache"
    )
    assert "cache_aware routes by the prefix cache" in cache
    assert "must be at least 1" in problems(pair, "--dp-size", "0")
    with pytest.raises(ConfigError, match="choose one of round_robin, shortest_queue"):
        resolve_server_args(ServerArgs(dp_size=2, load_balance_method="random", device="cpu"))
    # a share that fits: accepted
    prepare_server_args(
        argv(pair, "--dp-size", "2", "--gpu-id-step", "0", "--mem-fraction-static", "0.45")
    )


def test_placement():
    assert replica_gpus(2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_gpus(4, 1, base=4) == [[4], [5], [6], [7]]
    assert replica_gpus(2, 1, step=0) == [[0], [0]] and shared([[0], [0]])
    assert not shared(replica_gpus(8, 1)) and not shared(None)
    assert describe_placement([[0, 1, 2, 3], [4, 5, 6, 7]], 2) == [
        "replica 0: GPUs 0-3",
        "replica 1: GPUs 4-7",
    ]
    assert describe_placement(None, 2) == ["replica 0: cpu", "replica 1: cpu"]
    args = ServerArgs(dp_size=4, tp_size=2)
    with pytest.raises(ConfigError, match="needs GPU index 7, 4 visible"):
        check_gpus(replica_gpus(4, 2), 4, args)
    check_gpus(replica_gpus(2, 2), 4, args)


def test_the_offline_engine_refuses_dp():
    from ddtree import LLM

    with pytest.raises(ConfigError, match="an LLMEngine is one replica"):
        LLM(None, dp_size=2, device="cpu")
    with pytest.raises(ConfigError, match="an LLMEngine is one replica"):
        LLM(None, dp_replica_process=True, device="cpu")


def test_replica_process_flag_acts_with_one_engine_only(monkeypatch):
    """--dp-replica-process (the process boundary's A/B): with --dp-size 1 the server's engine is
    a replica process behind the dispatcher; with --dp-size N it is refused (they always are)."""
    from ddtree.server import launch
    from ddtree.server.dp import launch as dp_launch

    got = []
    monkeypatch.setattr(dp_launch, "start_dp_engine", lambda args, **kw: got.append(args) or 1 / 0)
    monkeypatch.setattr(launch, "build_engine", lambda args, gc: got.append("in-process") or 1 / 0)
    for flag, want in ((False, "in-process"), (True, "dp")):
        with pytest.raises(ZeroDivisionError):
            launch.build_app(ServerArgs(dp_replica_process=flag, device="cpu"))
        assert (got.pop() == "in-process") is (want == "in-process")
    with pytest.raises(ConfigError, match="--dp-replica-process: --dp-size 2"):
        resolve_server_args(ServerArgs(dp_size=2, dp_replica_process=True, device="cpu"))


def plan(capsys, pair, *extra) -> str:
    code = check_config(
        argv(pair, "--device-memory-gib", "96", "--context-length", "32768", *extra)
    )
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_check_config_dp8_shows_the_replicas_and_the_tp8_alternative(tmp_path, capsys):
    """The 27B at 96 GiB (issue 45's deployment): it fits one GPU, so --dp-size 8 is on offer, and
    check-config prints both sides of the trade with the plan's own numbers."""
    out = plan(capsys, hybrid_pair(tmp_path), "--dp-size", "8")
    assert "data parallel: 8 replicas x tp 1, 8 GPUs, --load-balance-method round_robin" in out
    assert "  replica 7: GPU 7" in out
    one = int(out.split("requests at context")[1].split("x")[0])  # the replica's plan
    assert f"all 8: {8 * one} requests at context" in out
    assert f"the model fits one GPU (tp 1: {one} requests at context" in out
    assert "--tp-size 8 instead: one group" in out


def test_check_config_tp8_names_the_dp8_alternative(tmp_path, capsys):
    out = plan(capsys, hybrid_pair(tmp_path), "--tp-size", "8")
    assert "data parallel:" not in out
    assert "this plan, 1 group of tp 8" in out
    assert "--dp-size 8 --tp-size 1: 8 replicas" in out


def test_check_config_dp2_tp4_and_a_shared_gpu(tmp_path, capsys):
    out = plan(capsys, dense_pair(tmp_path), "--dp-size", "2", "--tp-size", "4")
    assert "replica 0: GPUs 0-3" in out and "replica 1: GPUs 4-7" in out
    assert "this plan, 2 groups of tp 4" in out
    out = plan(
        capsys,
        dense_pair(tmp_path),
        "--dp-size",
        "2",
        "--gpu-id-step",
        "0",
        "--mem-fraction-static",
        "0.42",
    )
    assert "2 replicas x tp 1, 1 GPU" in out and "replicas share GPUs" in out
    assert "the model fits one GPU" not in out  # sharing one GPU is no choice between splits


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_serve_refuses_more_gpus_than_visible_before_any_replica_starts():
    """`ddtree serve --dp-size 2 --device cuda` where fewer GPUs are visible: exit 2 naming the fix,
    no traceback (the count is known only where the server starts; check-config plans anywhere)."""
    import subprocess
    import sys

    from server_fixtures import REPO_ROOT

    out = subprocess.run(
        [sys.executable, "-m", "ddtree.launch_server", "--device", "cuda", "--dp-size", "2"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "error: invalid configuration: --dp-size 2 x --tp-size 1" in out.stderr
    assert "Traceback" not in out.stderr


def test_cpu_replicas_split_the_cores(tmp_path, monkeypatch):
    """On the CPU every rank of every replica is a process: the automatic --cpu-threads is each
    one's share of the cores (here the 8B config's size would take them all)."""
    from ddtree.config import device as config_device

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(config_device, "available_cores", lambda: 8)
    pair = dense_pair(tmp_path)
    cpu = [a if a != "cuda" else "cpu" for a in argv(pair)]
    assert prepare_server_args(cpu + ["--tp-size", "2"]).cpu_threads == 4
    assert prepare_server_args(cpu + ["--dp-size", "2", "--tp-size", "2"]).cpu_threads == 2
