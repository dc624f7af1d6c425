"""--cpu-threads: the engine's torch threads on the CPU are chosen, not torch's default (one per
core made the embedded pair 7-10x slower on a 2-core machine): the flag, else OMP_NUM_THREADS, else
one thread per CPU_PARAMS_PER_THREAD parameters up to this process's share of the cores; and the
engine really runs with them. ~3 s."""

import pytest
import torch
from config_fixtures import dense_pair

from ddtree.config import device as config_device
from ddtree.config import prepare_server_args
from ddtree.models.configs import ConfigError


@pytest.fixture
def cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(config_device, "available_cores", lambda: 6)


def threads(*argv):
    return prepare_server_args(list(argv)).cpu_threads


def test_default_follows_the_model_size(tmp_path, cores):
    target = dense_pair(tmp_path)[0]  # Qwen3-8B's config: 8.2B parameters
    assert threads("--model-path", target, "--device", "cpu") == 6  # every core
    assert threads("--model-path", target, "--device", "cpu", "--tp-size", "2") == 3  # per rank
    assert threads("--device", "cpu") == 1  # the embedded 13M pair: one thread
    assert threads("--device", "cpu", "--speculative-algorithm", "DDTREE") == 1
    assert threads("--model-path", target, "--device", "cuda") is None  # torch's own


def test_omp_num_threads_and_the_flag_win(tmp_path, cores, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads("--device", "cpu") == 3
    assert threads("--device", "cpu", "--cpu-threads", "2") == 2
    assert threads("--device", "cuda", "--cpu-threads", "2") == 2  # acts on any device
    with pytest.raises(ConfigError) as info:
        prepare_server_args(["--device", "cpu", "--cpu-threads", "0"])
    assert "--cpu-threads 0" in info.value.problems[0]


def test_the_engine_runs_with_the_resolved_threads(tmp_path):
    from server_fixtures import build_tiny_pair

    from ddtree.llm import LLM

    target, _ = build_tiny_pair(str(tmp_path))
    before = torch.get_num_threads()
    try:
        for n in (2, 1):
            torch.set_num_threads(3)
            LLM(target, device="cpu", dtype="float32", cpu_threads=n)
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)
