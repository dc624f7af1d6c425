"""Defaults resolved per device (attention backend, CUDA graphs), and the config checks that stop a
configuration which resolves but cannot serve: a directory without weights, a block size off the
drafter's."""

import logging

import pytest
from config_fixtures import dense_pair, qwen3_8b_config, write_model_dir

from ddtree.config import ServerArgs, prepare_server_args, resolve_server_args
from ddtree.config import device as config_device
from ddtree.config import resolve as config_resolve
from ddtree.models.configs import ConfigError


@pytest.fixture
def dense(tmp_path):
    return dense_pair(tmp_path)


def ddtree_argv(pair, *extra):
    return [
        "--model-path",
        pair[0],
        "--speculative-draft-model-path",
        pair[1],
        "--speculative-algorithm",
        "DDTREE",
        *extra,
    ]


def problems_of(argv) -> list[str]:
    with pytest.raises(ConfigError) as info:
        prepare_server_args(argv)
    return info.value.problems


@pytest.fixture
def machine(monkeypatch):
    """machine(cuda, triton): fake the GPU probe and the triton lookup that resolution reads."""

    def set_machine(cuda: bool, triton: bool):
        monkeypatch.setattr(config_resolve, "cuda_available", lambda: cuda)
        monkeypatch.setattr(config_device, "triton_available", lambda: triton)

    return set_machine


def test_default_backend_flag_is_auto():
    assert ServerArgs().attention_backend == "auto"


def test_auto_on_cuda_with_triton_is_triton_with_graphs(dense, machine, caplog):
    caplog.set_level(logging.INFO, logger="ddtree")
    machine(cuda=True, triton=True)
    args = prepare_server_args(ddtree_argv(dense))
    assert (args.device, args.attention_backend, args.disable_cuda_graph) == (
        "cuda",
        "triton",
        False,
    )
    assert args.cuda_graph_max_bs == 16
    assert any(m.startswith("Attention backend is set to triton") for m in caplog.messages)
    assert any("CUDA graphs are enabled" in m for m in caplog.messages)


def test_auto_on_cuda_without_triton_is_reference_with_reason(dense, machine, caplog):
    caplog.set_level(logging.INFO, logger="ddtree")
    machine(cuda=True, triton=False)
    args = prepare_server_args(ddtree_argv(dense))
    assert (args.device, args.attention_backend, args.disable_cuda_graph) == ("cuda", "torch", True)
    assert any(
        "Attention backend is set to torch" in m and "triton is not installed" in m
        for m in caplog.messages
    )
    assert any("CUDA graphs are disabled" in m for m in caplog.messages)


@pytest.mark.parametrize("triton", [True, False])
def test_auto_on_cpu_is_reference(dense, machine, caplog, triton):
    caplog.set_level(logging.INFO, logger="ddtree")
    machine(cuda=False, triton=triton)
    args = prepare_server_args(ddtree_argv(dense))
    assert (args.device, args.attention_backend, args.disable_cuda_graph) == ("cpu", "torch", True)
    assert any(m.startswith("Attention backend is set to torch") for m in caplog.messages)


def test_explicit_device_cpu_on_a_gpu_machine_is_reference(dense, machine):
    machine(cuda=True, triton=True)
    args = prepare_server_args(ddtree_argv(dense, "--device", "cpu"))
    assert (args.attention_backend, args.disable_cuda_graph) == ("torch", True)


def test_explicit_backend_is_kept(dense, machine):
    machine(cuda=True, triton=True)
    args = prepare_server_args(ddtree_argv(dense, "--attention-backend", "torch"))
    assert (args.attention_backend, args.disable_cuda_graph) == ("torch", True)
    args = prepare_server_args(ddtree_argv(dense, "--disable-cuda-graph"))
    assert (args.attention_backend, args.disable_cuda_graph) == ("triton", True)


def test_explicit_triton_without_triton_is_refused(dense, machine):
    machine(cuda=True, triton=False)
    problems = problems_of(ddtree_argv(dense, "--attention-backend", "triton"))
    assert any(
        p.startswith("--attention-backend triton") and "pip install triton" in p for p in problems
    )


def test_resolved_backend_is_never_auto(dense):
    """The engine's registry knows torch and triton only: resolution replaces auto everywhere."""
    args = resolve_server_args(ServerArgs(model_path=dense[0]))
    assert args.attention_backend in ("torch", "triton")


def test_config_only_dirs_resolve_and_plan_weights_are_checked_at_load(tmp_path, capsys):
    """Validating the Qwen3.6-27B + DFlash flags before the 55 GB download: the config.json files
    are all that parsing and planning read; the missing weights are named where they would load
    (`serve`'s start: exit 2 before any engine is built; the engine itself: a ConfigError)."""
    from config_fixtures import qwen36_27b_config, qwen36_27b_dflash_config

    from ddtree.engine.setup import build_runner
    from ddtree.models.sources import weight_problems
    from ddtree.server import launch

    target = write_model_dir(tmp_path, "Qwen3.6-27B", qwen36_27b_config(), weights=False)
    drafter = write_model_dir(
        tmp_path, "Qwen3.6-27B-DFlash", qwen36_27b_dflash_config(), weights=False
    )
    argv = [
        "--model-path",
        target,
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        drafter,
        "--speculative-ddtree-budget",
        "16",
        "--device",
        "cuda",
    ]
    args = prepare_server_args(argv)
    assert args.target_config.is_hybrid and args.drafter_config.block_size > 1
    problems = weight_problems(args)
    assert len(problems) == 2
    assert problems[0].startswith(f"--model-path {target}: no *.safetensors weights")
    assert problems[1].startswith(f"--speculative-draft-model-path {drafter}: no *.safetensors")
    cpu_args = prepare_server_args(argv[:-1] + ["cpu"])
    with pytest.raises(ConfigError) as info:
        build_runner(cpu_args, __import__("torch").device("cpu"))
    assert info.value.problems == weight_problems(cpu_args)

    def no_engine(*a, **k):
        raise AssertionError("the engine was built for a directory without weights")

    old = launch.build_app
    launch.build_app = no_engine
    try:
        assert launch.main(argv[:-1] + ["cpu"]) == 2
    finally:
        launch.build_app = old
    err = capsys.readouterr().err
    assert f"--model-path {target}: no *.safetensors weights" in err and drafter in err


def test_sharded_index_counts_as_weights(tmp_path):
    from ddtree.models.sources import weight_problems

    target = write_model_dir(tmp_path, "sharded", qwen3_8b_config(), weights=False)
    assert weight_problems(prepare_server_args(["--model-path", target]))
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text("{}")
    args = prepare_server_args(["--model-path", target])
    assert args.model_path == target and weight_problems(args) == []


def test_smaller_block_than_trained_is_warned(dense, caplog):
    args = prepare_server_args(ddtree_argv(dense, "--speculative-dflash-block-size", "7"))
    assert args.speculative_dflash_block_size == 7 and args.speculative_num_draft_tokens == 7
    hits = [r for r in caplog.records if "--speculative-dflash-block-size 7" in r.getMessage()]
    assert hits and hits[0].levelno == logging.WARNING
    assert (
        "trained block_size 16" in hits[0].getMessage() and "drop the flag" in hits[0].getMessage()
    )


def test_trained_block_size_is_silent(dense, caplog):
    prepare_server_args(ddtree_argv(dense, "--speculative-dflash-block-size", "16"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_replaced_resolved_args_carries_its_own_spec(dense):
    """`dataclasses.replace` of resolved args (generate --compare-ar's AR run) must not keep the
    speculative run's derived SpecConfig: the engine sizes and decodes by `args.spec`."""
    import dataclasses

    args = prepare_server_args(ddtree_argv(dense, "--device", "cpu"))
    assert args.spec.algorithm == "DDTREE" and args.spec.budget > 0
    ar = dataclasses.replace(args, speculative_algorithm="NONE")
    assert ar.spec.algorithm == "NONE" and ar.spec.block_size == 1
    assert dataclasses.replace(args, speculative_ddtree_budget=8).spec.budget == 8
