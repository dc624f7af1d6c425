import ast
import dataclasses
import os
import subprocess
import sys

import pytest
from config_fixtures import (
    dense_pair,
    hybrid_pair,
    qwen3_8b_config,
    qwen36_27b_config,
    write_model_dir,
)

from ddtree.config import prepare_server_args
from ddtree.config.check_config import main
from ddtree.config.memory_plan import (
    DTYPE_BYTES,
    MemoryPlan,
    memory_plan,
    recurrent_state_bytes,
)
from ddtree.models.configs import TargetConfig, target_param_count

GIB = 2**30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ddtree_args(pair, *extra):
    target, drafter = pair
    # planned for a GPU deployment (on the CPU, dtype auto resolves to float32)
    return prepare_server_args(
        [
            "--model-path",
            target,
            "--speculative-algorithm",
            "DDTREE",
            "--device",
            "cuda",
            "--speculative-draft-model-path",
            drafter,
            *extra,
        ]
    )


def test_qwen3_8b_plan(tmp_path):
    plan = memory_plan(ddtree_args(dense_pair(tmp_path)), device_bytes=140 * GIB)
    assert plan.target_weight_bytes == pytest.approx(16.38e9, rel=0.01)
    assert plan.drafter_weight_bytes == pytest.approx(2.1e9, rel=0.01)
    assert plan.target_kv_bytes_per_token == 2 * 36 * 8 * 128 * 2
    assert plan.drafter_kv_bytes_per_token == 2 * 5 * 8 * 128 * 2
    assert plan.verify_width == 65 and plan.max_running_requests == 48
    assert plan.verify_buffer_bytes_per_request >= 65 * 151936 * 4
    assert plan.state_pool_requests is None and plan.state_bytes_per_request == 0
    assert plan.kv_tokens % 16 == 0
    expected_kv = (
        plan.static_bytes - plan.weight_bytes_per_device - plan.workspace_bytes - plan.graph_bytes
    )
    assert plan.kv_room_bytes == expected_kv and plan.kv_limit == "memory"
    scratch = 16 * 5  # one verify width (65) of scratch pages comes out of the same bytes
    assert plan.kv_tokens == expected_kv // plan.kv_bytes_per_token_per_device // 16 * 16 - scratch
    assert plan.kv_pool_bytes == (plan.kv_tokens + scratch) * plan.kv_bytes_per_token_per_device
    assert plan.kv_pool_bytes <= plan.kv_room_bytes
    assert (
        plan.requests_at_context == plan.kv_tokens // 40960 > 0 and plan.fits and not plan.warnings
    )
    text = plan.format()
    assert "KV per token" in text and "16.38 GB" in text


def test_tp_halves_per_device_numbers(tmp_path):
    pair = dense_pair(tmp_path)
    one = memory_plan(ddtree_args(pair), device_bytes=80 * GIB)
    two = memory_plan(dataclasses.replace(ddtree_args(pair), tp_size=2), device_bytes=80 * GIB)
    # norms and the drafter's fc stay whole on every rank
    assert two.weight_bytes_per_device == pytest.approx(one.weight_bytes_per_device / 2, rel=0.01)
    assert two.weight_bytes_per_device > one.weight_bytes_per_device / 2
    assert two.kv_bytes_per_token_per_device * 2 == one.kv_bytes_per_token_per_device


def test_tp8_replicates_the_27b_kv_heads(tmp_path):
    """Qwen3.6-27B at tp 8 (issue 23's deployment): 4 KV heads, one per rank (each on 2 ranks), so
    per-rank target KV is a quarter of the model's, while GDN state splits 8 ways."""
    args = ddtree_args(hybrid_pair(tmp_path), "--max-running-requests", "4")
    one = memory_plan(args, device_bytes=140 * GIB)
    eight = memory_plan(dataclasses.replace(args, tp_size=8), device_bytes=140 * GIB)
    assert eight.tp_size == 8 and eight.fits
    d_kv = one.drafter_kv_bytes_per_token
    assert eight.kv_bytes_per_token_per_device == one.target_kv_bytes_per_token // 4 + d_kv // 8
    assert eight.state_bytes_per_request * 8 == one.state_bytes_per_request
    assert eight.weight_bytes_per_device < one.weight_bytes_per_device / 7


def test_hybrid_plan_state_split(tmp_path):
    args = ddtree_args(
        hybrid_pair(tmp_path),
        *("--mamba-full-memory-ratio", "0.5", "--max-running-requests", "4"),
        *("--mamba-scheduler-strategy", "extra_buffer"),
    )
    plan = memory_plan(args, device_bytes=140 * GIB)
    assert plan.target_params == pytest.approx(26.9e9, rel=0.01)
    assert plan.drafter_params == pytest.approx(1.73e9, rel=0.01)
    assert plan.target_kv_bytes_per_token == 2 * 16 * 4 * 256 * 2
    conv = 48 * (2 * 16 * 128 + 48 * 128) * 3 * 2
    ssm = 48 * 48 * 128 * 128 * 4
    assert plan.state_bytes_per_request == conv + ssm
    assert plan.spec_state_bytes_per_request == 65 * (conv + ssm)
    rest = (
        plan.static_bytes - plan.weight_bytes_per_device - plan.workspace_bytes - plan.graph_bytes
    )
    assert plan.state_room_bytes == int(rest * 0.5 / 1.5)
    assert plan.kv_room_bytes == rest - plan.state_room_bytes
    # one row of the pool is the scratch row of padded CUDA-graph rows
    assert plan.state_pool_requests == plan.state_room_bytes // (66 * (conv + ssm)) - 1
    assert plan.state_pool_bytes <= plan.state_room_bytes
    assert plan.requests_at_context <= plan.state_pool_requests
    assert "state pool" in plan.format()


def test_hybrid_state_pool_caps_concurrency_warning(tmp_path):
    args = ddtree_args(hybrid_pair(tmp_path), "--mamba-scheduler-strategy", "extra_buffer")
    plan = memory_plan(args, device_bytes=140 * GIB)
    assert plan.state_pool_requests < 48
    assert any("--max-running-requests" in w for w in plan.warnings)


def test_hybrid_default_no_buffer_plans_more_requests(tmp_path):
    # the speculative default keeps each node's GDN inputs, not its state: many more rows fit
    pair = hybrid_pair(tmp_path)
    plan = memory_plan(ddtree_args(pair), device_bytes=140 * GIB)
    extra = memory_plan(
        ddtree_args(pair, "--mamba-scheduler-strategy", "extra_buffer"), device_bytes=140 * GIB
    )
    assert plan.spec_state_bytes_per_request < extra.spec_state_bytes_per_request / 4
    assert plan.state_pool_requests > 4 * extra.state_pool_requests


def test_weights_too_big_warns(tmp_path):
    plan = memory_plan(ddtree_args(dense_pair(tmp_path)), device_bytes=8 * GIB)
    assert not plan.fits and any("--mem-fraction-static" in w for w in plan.warnings)


def test_default_device_bytes(tmp_path):
    args = prepare_server_args(["--model-path", dense_pair(tmp_path)[0], "--device", "cpu"])
    plan = memory_plan(args)
    assert isinstance(plan, MemoryPlan) and plan.device_name == "host RAM" and plan.device_bytes > 0


def _count(model) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("mtp"))


def test_param_count_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    small = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    with torch.device("meta"):
        dense = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=3, **small))
        hybrid_cfg = Qwen3_5TextConfig(
            num_hidden_layers=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=24,
            **small,
        )
        hybrid = Qwen3_5ForCausalLM(hybrid_cfg)
    assert target_param_count(TargetConfig.from_dict(dense.config.to_dict())) == _count(dense)
    assert target_param_count(TargetConfig.from_dict(hybrid_cfg.to_dict())) == _count(hybrid)


def test_recurrent_state_bytes_bf16_ssm():
    t = TargetConfig.from_dict(qwen36_27b_config())
    conv, ssm = recurrent_state_bytes(t, 2, DTYPE_BYTES["bfloat16"])
    assert ssm == 48 * 48 * 128 * 128 * 2 and conv == 48 * 10240 * 3 * 2


def test_check_config_main_ok(tmp_path, capsys):
    target, drafter = dense_pair(tmp_path)
    rc = main(
        [
            "check-config",
            "--model-path",
            target,
            "--speculative-algorithm",
            "ddtree",
            "--speculative-draft-model-path",
            drafter,
            "--device",
            "cuda",
            "--device-memory-gib",
            "80",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "speculative_ddtree_budget" in out and "memory plan" in out and "KV per token" in out
    assert "mem_fraction_static" not in out  # default fields are not printed


def test_check_config_main_hybrid(tmp_path, capsys):
    target, drafter = hybrid_pair(tmp_path)
    rc = main(
        [
            "--model-path",
            target,
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            drafter,
            "--mamba-scheduler-strategy",
            "extra_buffer",
            "--mamba-full-memory-ratio",
            "0.5",
            "--device",
            "cuda",
            "--device-memory-gib",
            "140",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "state pool" in out and "hybrid (48 GDN + 16 attention layers)" in out


def test_check_config_main_bad_config(tmp_path, capsys):
    target = dense_pair(tmp_path, target=qwen3_8b_config(num_hidden_layers=28))[0]
    rc = main(
        [
            "--model-path",
            target,
            "--speculative-algorithm",
            "DDTREE",
            "--tp-size",
            "3",
            "--speculative-draft-model-path",
            str(tmp_path / "Qwen3-8B-DFlash-b16"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "error: invalid configuration:" in err
    assert "--tp-size" in err and "--speculative-draft-model-path" in err


def test_check_config_weights_over_pool_exits_1(tmp_path, capsys):
    target, drafter = dense_pair(tmp_path)
    rc = main(
        [
            "--model-path",
            target,
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            drafter,
            "--device",
            "cuda",
            "--device-memory-gib",
            "8",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 1
    assert "memory plan" in captured.out  # the plan is still printed, to show where the memory goes
    assert "error: this configuration resolves but cannot serve:" in captured.err
    assert "exceed the static pool" in captured.err and "--mem-fraction-static" in captured.err


def test_check_config_zero_requests_at_context_exits_1(tmp_path, capsys):
    target, drafter = dense_pair(tmp_path)
    rc = main(
        [
            "--model-path",
            target,
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            drafter,
            "--device",
            "cuda",
            "--device-memory-gib",
            "25",  # weights, verify buffers, CUDA graphs and 4,096 KV tokens
            "--max-total-tokens",
            "4096",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "not one request of --context-length 40960 fits (4,096 KV tokens); lower" in err


def test_check_config_says_what_it_planned_for(tmp_path, capsys):
    target, drafter = dense_pair(tmp_path)
    argv = [
        "--model-path",
        target,
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        drafter,
    ]
    assert main([*argv, "--device", "cuda", "--device-memory-gib", "140"]) == 0
    out = capsys.readouterr().out
    assert "planned for: device cuda (140 GiB given by --device-memory-gib), dtype bfloat16" in out
    # the CPU engine caps its KV pool (CPU_KV_BUDGET_BYTES): an 8B pair in fp32 fits a 4k context
    assert (
        main([*argv, "--device", "cpu", "--device-memory-gib", "512", "--context-length", "4096"])
        == 0
    )
    out = capsys.readouterr().out
    assert "planned for: device cpu" in out and "dtype float32" in out
    assert "--device cuda --device-memory-gib 140" in out  # how to plan for the GPU instead


def test_check_config_cuda_without_gpu_needs_a_size(tmp_path, capsys, monkeypatch):
    import ddtree.config.check_config as cc

    monkeypatch.setattr(cc, "cuda_available", lambda: False)
    target = dense_pair(tmp_path)[0]
    assert main(["--model-path", target, "--device", "cuda"]) == 2
    assert "--device-memory-gib" in capsys.readouterr().err


def test_check_config_plans_a_config_only_dir(tmp_path, capsys):
    """Planning before the download: config.json is all the plan reads; the missing weights are a
    note (serving needs them), not a failure."""
    target = write_model_dir(tmp_path, "bare", qwen3_8b_config(), weights=False)
    argv = ["--model-path", target, "--device", "cuda", "--device-memory-gib", "80"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "planned for: device cuda (80 GiB" in out and "KV pool" in out
    assert f"note: --model-path {target}: no *.safetensors weights" in out


def test_check_config_main_bad_flag(capsys):
    assert main(["--speculative-algorithm", "MEDUSA"]) == 2
    assert "invalid choice" in capsys.readouterr().err


# what makes a check-config run take seconds: none of it is imported (checked, not timed)
HEAVY = ("torch", "transformers", "triton", "numpy", "safetensors", "tokenizers", "fastapi")


def _run_check_config(tmp_path, prelude: str) -> list[str]:
    """The heavy packages a check-config run imported (in a fresh interpreter)."""
    target, drafter = hybrid_pair(tmp_path)
    code = (
        prelude + "import sys; from ddtree.config.check_config import main; "
        f"rc = main(['--model-path', {target!r}, '--speculative-algorithm', 'DDTREE', "
        f"'--speculative-draft-model-path', {drafter!r}, '--device', 'cuda', "
        "'--device-memory-gib', '140']); "
        f"assert rc == 0, rc; print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_check_config_modules_are_light_and_torch_free(tmp_path):
    # a bare `ddtree` package object isolates these modules from whatever ddtree/__init__.py imports
    prelude = (
        "import sys, types; pkg = types.ModuleType('ddtree'); "
        f"pkg.__path__ = [{os.path.join(REPO, 'ddtree')!r}]; sys.modules['ddtree'] = pkg; "
    )
    assert _run_check_config(tmp_path, prelude) == []


def test_ddtree_check_config_cli_path_is_torch_free(tmp_path):
    assert _run_check_config(tmp_path, "") == []


def test_cpu_tensor_parallel_ranks_share_the_host_memory(tmp_path, capsys):
    """On the CPU every rank's process allocates from the same RAM: a rank plans with 1/tp of it
    (the engine and check-config alike, `plan_pools`), so 8 ranks of an 8B pair on a 23.5 GiB
    host are refused instead of each planning against the whole host (~110 GiB in all)."""
    from ddtree.engine.config import plan_pools

    target, drafter = dense_pair(tmp_path)
    argv = [
        "--model-path",
        target,
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        drafter,
        "--device",
        "cpu",
        "--context-length",
        "4096",
    ]
    assert main([*argv, "--tp-size", "8", "--device-memory-gib", "23.5"]) == 1
    captured = capsys.readouterr()
    assert "static pool 2.50 GiB per rank (the 8 ranks share it" in captured.out
    assert "the 8 ranks share the host's RAM" in captured.err and "--tp-size" in captured.err
    # the same host, one rank: the whole RAM, and the plan no longer pretends 8x of it exists
    assert main([*argv, "--tp-size", "1", "--device-memory-gib", "512"]) == 0
    one = capsys.readouterr().out
    assert main([*argv, "--tp-size", "8", "--device-memory-gib", "512"]) == 0
    assert "per rank" in capsys.readouterr().out and "per rank" not in one
    args = prepare_server_args([*argv, "--tp-size", "8"])
    host = 512 * 2**30
    pools = plan_pools(args, host, 2**30, "cpu")
    assert pools.static_bytes == int(host // 8 * args.mem_fraction_static)
    gpu = plan_pools(args, host, 2**30, "cuda")  # a GPU rank has its own memory
    assert gpu.static_bytes == int(host * args.mem_fraction_static)


def test_extra_buffer_that_starves_the_pools_suggests_no_buffer(tmp_path, capsys):
    """The 27B hybrid at 96 GB under extra_buffer: a state per tree node (9 GiB a request at budget
    64) leaves the state pool no request and the KV pool its minimum; the plan says so and gives
    no_buffer's numbers, which are the no_buffer plan's own."""
    target, drafter = hybrid_pair(tmp_path)
    argv = [
        "--model-path",
        target,
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        drafter,
        "--device",
        "cuda",
        "--context-length",
        "32768",
    ]
    gib = 96 * 2**30
    extra = memory_plan(
        prepare_server_args([*argv, "--mamba-scheduler-strategy", "extra_buffer"]), gib
    )
    plain = memory_plan(
        prepare_server_args([*argv, "--mamba-scheduler-strategy", "no_buffer"]), gib
    )
    assert extra.state_pool_requests == 0 and plain.state_pool_requests > 0
    hint = extra.warnings[0]
    assert hint.startswith("--mamba-scheduler-strategy extra_buffer keeps a recurrent state")
    assert "--mamba-scheduler-strategy no_buffer" in hint
    assert f"{plain.state_pool_requests} requests, {plain.kv_tokens:,} KV tokens" in hint
    assert f"({plain.requests_at_context} requests at context)" in hint
    assert not any("extra_buffer" in w for w in plain.warnings)
    assert (
        main([*argv, "--mamba-scheduler-strategy", "extra_buffer", "--device-memory-gib", "96"])
        == 1
    )
    assert "no_buffer (replays the accepted path instead)" in capsys.readouterr().err
    # an extra_buffer plan that serves its requests gets no hint
    small = [*argv, "--speculative-ddtree-budget", "8", "--max-running-requests", "4"]
    fits = memory_plan(
        prepare_server_args([*small, "--mamba-scheduler-strategy", "extra_buffer"]), gib
    )
    assert fits.fits and fits.state_pool_requests >= 4
    assert not any("no_buffer" in w for w in fits.warnings)


def test_check_config_names_max_total_tokens_when_it_is_the_cap(capsys):
    """The embedded pair on this host: memory holds many requests at context, --max-total-tokens 64
    holds none; the plan prints the pool that cap allocates and names the flag that binds."""
    rc = main(["--device", "cpu", "--max-total-tokens", "64"])
    err, out = capsys.readouterr()
    text = out + err
    assert rc == 1
    assert "KV pool              0.5 MiB -> 64 tokens (held by --max-total-tokens" in text
    assert "raise --max-total-tokens or lower --context-length" in text
