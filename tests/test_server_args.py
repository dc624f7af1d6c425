import dataclasses
import logging
import sys
import types

import pytest
from config_fixtures import (
    DELETE,
    dense_pair,
    hybrid_pair,
    qwen3_8b_config,
    qwen3_8b_dflash_config,
    qwen36_27b_dflash_config,
    write_model_dir,
)

from ddtree.config import ServerArgs, make_parser, prepare_server_args, resolve_server_args
from ddtree.engine.config import spec_config
from ddtree.models.configs import ConfigError, DrafterConfig, TargetConfig

DDTREE_FLAGS = [
    "--speculative-algorithm",
    "DDTREE",
    "--speculative-dflash-block-size",
    "16",
    "--speculative-ddtree-budget",
    "64",
    "--speculative-ddtree-topk-cap",
    "64",
    "--speculative-ddtree-shadow-linear",
]


def spec_tuple(a: ServerArgs):
    return (
        a.speculative_algorithm,
        a.speculative_num_draft_tokens,
        a.speculative_ddtree_budget,
        a.speculative_ddtree_topk_cap,
        a.speculative_ddtree_shadow_linear,
    )


def problems_of(argv) -> list[str]:
    with pytest.raises(ConfigError) as info:
        prepare_server_args(argv)
    return info.value.problems


def one_problem(argv, *needles) -> str:
    problems = problems_of(argv)
    hits = [p for p in problems if all(n in p for n in needles)]
    assert hits, f"no problem mentions {needles}: {problems}"
    return hits[0]


@pytest.fixture
def dense(tmp_path):
    return dense_pair(tmp_path)


@pytest.fixture
def hybrid(tmp_path):
    return hybrid_pair(tmp_path)


def ddtree_argv(pair, *extra):
    target, drafter = pair
    return [
        "--model-path",
        target,
        "--speculative-draft-model-path",
        drafter,
        *DDTREE_FLAGS,
        *extra,
    ]


def test_acceptance_dense(dense):
    args = prepare_server_args(ddtree_argv(dense))
    assert spec_tuple(args) == ("DDTREE", 16, 64, 64, True)


def test_acceptance_hybrid(hybrid):
    args = prepare_server_args(
        ddtree_argv(
            hybrid, "--mamba-scheduler-strategy", "extra_buffer", "--mamba-full-memory-ratio", "0.5"
        )
    )
    assert spec_tuple(args) == ("DDTREE", 16, 64, 64, True)
    assert args.mamba_scheduler_strategy == "extra_buffer" and args.mamba_full_memory_ratio == 0.5
    assert args.target_config.is_hybrid and len(args.target_config.linear_layer_ids) == 48
    assert args.drafter_config.block_size == 16 and args.drafter_config.sliding_window == 2048


def test_parser_defaults_come_from_dataclass():
    ns = vars(make_parser().parse_args([]))
    for f in dataclasses.fields(ServerArgs):
        if f.metadata.get("cli", True):
            assert ns[f.name] == f.default, f.name
    assert ServerArgs().mem_fraction_static == 0.85 and ServerArgs().page_size == 16
    assert ServerArgs().chunked_prefill_size == 2048 and ServerArgs().port == 30000


def test_server_args_frozen_and_configs_attached(dense):
    args = prepare_server_args(ddtree_argv(dense))
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.port = 1
    assert isinstance(args.target_config, TargetConfig) and isinstance(
        args.drafter_config, DrafterConfig
    )
    assert "target_config" not in repr(args)
    assert resolve_server_args(args) == args  # idempotent; configs excluded from ==


def test_resolved_defaults_are_logged(dense, caplog):
    caplog.set_level(logging.INFO, logger="ddtree")
    target, drafter = dense
    args = prepare_server_args(
        [
            "--model-path",
            target,
            "--speculative-algorithm",
            "ddtree",
            "--device",
            "cuda",
            "--speculative-draft-model-path",
            drafter,
        ]
    )
    assert spec_tuple(args) == ("DDTREE", 16, 64, 64, False)
    assert args.speculative_dflash_block_size == 16 and args.max_running_requests == 48
    assert args.dtype == "bfloat16" and args.context_length == 40960
    assert spec_config(args).verify_width == 65
    cpu = prepare_server_args(["--model-path", target, "--device", "cpu"])
    assert cpu.dtype == "float32" and any("float32 on the CPU" in m for m in caplog.messages)
    assert "Max running requests is reset to 48 for speculative decoding." in caplog.messages
    assert any("block size is set to 16" in m for m in caplog.messages)
    assert any("budget is set to 64" in m for m in caplog.messages)


def test_non_speculative_defaults(dense, caplog):
    caplog.set_level(logging.INFO, logger="ddtree")
    args = prepare_server_args(["--model-path", dense[0]])
    assert args.speculative_algorithm == "NONE" and args.max_running_requests == 256
    assert args.drafter_config is None and args.speculative_num_draft_tokens is None
    assert any("Max running requests is set to 256" in m for m in caplog.messages)


def test_dflash_resolution(dense, caplog):
    target, drafter = dense
    args = prepare_server_args(
        [
            "--model-path",
            target,
            "--speculative-algorithm",
            "dflash",
            "--speculative-draft-model-path",
            drafter,
            "--speculative-ddtree-budget",
            "32",
        ]
    )
    assert args.speculative_algorithm == "DFLASH" and args.speculative_num_draft_tokens == 16
    assert args.speculative_ddtree_budget is None and spec_config(args).verify_width == 16
    assert any("--speculative-ddtree-budget" in m and "DDTREE only" in m for m in caplog.messages)


def test_missing_and_empty_paths(tmp_path, dense):
    assert "does not exist" in one_problem(["--model-path", str(tmp_path / "nope")], "--model-path")
    (tmp_path / "empty").mkdir()
    assert "config.json" in one_problem(["--model-path", str(tmp_path / "empty")], "--model-path")
    one_problem(
        [
            "--model-path",
            dense[0],
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            str(tmp_path / "nope"),
        ],
        "--speculative-draft-model-path",
        "does not exist",
    )


def test_unknown_architecture(tmp_path):
    path = write_model_dir(tmp_path, "llama", qwen3_8b_config(architectures=["LlamaForCausalLM"]))
    msg = one_problem(["--model-path", path], "--model-path", "LlamaForCausalLM")
    assert "Qwen3ForCausalLM" in msg and "Qwen3_5ForConditionalGeneration" in msg


def test_drafter_passed_as_target(dense):
    one_problem(["--model-path", dense[1]], "--model-path", "--speculative-draft-model-path")


def test_drafter_not_dflash(dense):
    argv = [
        "--model-path",
        dense[0],
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        dense[0],
    ]
    one_problem(argv, "--speculative-draft-model-path", "DFlashDraftModel")


def bad_drafter_argv(tmp_path, target_dir, drafter_cfg, *extra):
    drafter = write_model_dir(tmp_path, "bad-drafter", drafter_cfg)
    return [
        "--model-path",
        target_dir,
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        drafter,
        *extra,
    ]


def test_drafter_hidden_and_vocab_mismatch(tmp_path, dense):
    argv = bad_drafter_argv(
        tmp_path, dense[0], qwen3_8b_dflash_config(hidden_size=2560, vocab_size=151000)
    )
    problems = problems_of(argv)
    assert any("--speculative-draft-model-path" in p and "hidden_size 2560" in p for p in problems)
    assert any("--speculative-draft-model-path" in p and "vocab_size 151000" in p for p in problems)


def test_mask_token_missing_or_out_of_vocab(tmp_path, dense):
    missing = qwen3_8b_dflash_config(dflash_overrides={"mask_token_id": DELETE})
    one_problem(
        bad_drafter_argv(tmp_path, dense[0], missing),
        "--speculative-draft-model-path",
        "mask_token_id",
    )
    big = qwen3_8b_dflash_config(dflash_overrides={"mask_token_id": 151936})
    one_problem(
        bad_drafter_argv(tmp_path, dense[0], big), "--speculative-draft-model-path", "151936"
    )


def test_target_layer_ids_out_of_range(tmp_path, dense):
    cfg = qwen3_8b_dflash_config(
        dflash_overrides={"target_layer_ids": [1, 9, 17, 25, 40]}, num_target_layers=DELETE
    )
    msg = one_problem(
        bad_drafter_argv(tmp_path, dense[0], cfg), "--speculative-draft-model-path", "[40]"
    )
    assert "valid 0..35" in msg


def test_drafter_built_for_other_target(tmp_path, dense):
    cfg = qwen3_8b_dflash_config(num_target_layers=28)
    one_problem(
        bad_drafter_argv(tmp_path, dense[0], cfg), "--speculative-draft-model-path", "28-layer"
    )


def test_hybrid_drafter_on_dense_target_reports_everything(tmp_path, dense):
    problems = problems_of(bad_drafter_argv(tmp_path, dense[0], qwen36_27b_dflash_config()))
    assert len(problems) >= 4  # hidden, vocab, mask, layer ids, num_target_layers
    assert all("--speculative-draft-model-path" in p for p in problems)


def test_block_size_bounds(dense):
    one_problem(
        ddtree_argv(dense, "--speculative-dflash-block-size", "32"),
        "--speculative-dflash-block-size",
        "16",
    )
    one_problem(
        ddtree_argv(dense, "--speculative-dflash-block-size", "1"),
        "--speculative-dflash-block-size",
    )


def test_budget_and_topk_cap_bounds(dense):
    problems = problems_of(
        ddtree_argv(dense, "--speculative-ddtree-budget", "0", "--speculative-ddtree-topk-cap", "0")
    )
    assert any("--speculative-ddtree-budget" in p for p in problems)
    assert any("--speculative-ddtree-topk-cap" in p for p in problems)


@pytest.mark.parametrize("algo", ["DDTREE", "DFLASH"])
def test_speculative_requires_drafter(dense, algo):
    one_problem(
        ["--model-path", dense[0], "--speculative-algorithm", algo],
        "--speculative-draft-model-path",
        algo,
    )


def test_embedded_default_pair(dense, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="ddtree")
    monkeypatch.setitem(
        sys.modules, "ddtree.assets", types.SimpleNamespace(default_model_paths=lambda: dense)
    )
    args = prepare_server_args(["--speculative-algorithm", "DDTREE"])
    assert (args.model_path, args.speculative_draft_model_path) == dense
    assert any("embedded default model pair" in m for m in caplog.messages)


def test_embedded_default_pair_unavailable(monkeypatch):
    def broken():
        raise FileNotFoundError("assets not installed")

    monkeypatch.setitem(
        sys.modules, "ddtree.assets", types.SimpleNamespace(default_model_paths=broken)
    )
    one_problem([], "--model-path", "assets not installed")


def test_dflash_num_draft_tokens_must_equal_block(dense):
    argv = [
        "--model-path",
        dense[0],
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        dense[1],
        "--speculative-num-draft-tokens",
        "8",
    ]
    one_problem(argv, "--speculative-num-draft-tokens", "16")


def test_tp_size(dense, hybrid):
    one_problem(ddtree_argv(dense, "--tp-size", "0"), "--tp-size")
    # Qwen3.6-27B's 4 KV heads at tp 8: replicated, as SGLang does (issue 23)
    assert prepare_server_args(ddtree_argv(hybrid, "--tp-size", "8")).tp_size == 8
    msg = one_problem(ddtree_argv(hybrid, "--tp", "3"), "--tp-size 3", "KV heads (4")
    assert "valid --tp-size values: [1, 2, 4, 8]" in msg
    assert prepare_server_args(ddtree_argv(hybrid, "--tp", "1")).tp_size == 1


def test_context_length_warns_past_max_position(dense, caplog):
    args = prepare_server_args(["--model-path", dense[0], "--context-length", "65536"])
    assert args.context_length == 65536
    assert any("--context-length" in m and "max_position_embeddings" in m for m in caplog.messages)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--mem-fraction-static", "0"),
        ("--mem-fraction-static", "1.2"),
        ("--mamba-full-memory-ratio", "0"),
        ("--mamba-full-memory-ratio", "1"),
    ],
)
def test_fraction_bounds(dense, flag, value):
    one_problem(["--model-path", dense[0], flag, value], flag)


def test_hybrid_speculative_default_no_buffer(hybrid, caplog):
    caplog.set_level(logging.INFO, logger="ddtree")
    args = prepare_server_args(ddtree_argv(hybrid))
    assert args.mamba_scheduler_strategy == "no_buffer"
    assert any("no_buffer" in m and "hybrid" in m and "replayed" in m for m in caplog.messages)


def test_hybrid_no_buffer_with_speculation_commits_by_replay(hybrid, caplog):
    # ddtree can verify trees without per-node states: it replays the accepted path (SGLang refuses this)
    caplog.set_level(logging.INFO, logger="ddtree")
    args = prepare_server_args(ddtree_argv(hybrid, "--mamba-scheduler-strategy", "no_buffer"))
    assert args.mamba_scheduler_strategy == "no_buffer"
    assert any("replayed" in m for m in caplog.messages)


def test_mamba_strategy_on_dense_target_ignored(dense, caplog):
    args = prepare_server_args(ddtree_argv(dense, "--mamba-scheduler-strategy", "extra_buffer"))
    assert args.mamba_scheduler_strategy is None
    assert any("--mamba-scheduler-strategy" in m and "dense" in m for m in caplog.messages)


def test_speculative_flags_without_algorithm_warn(dense, caplog):
    args = prepare_server_args(["--model-path", dense[0], "--speculative-ddtree-budget", "32"])
    assert args.speculative_algorithm == "NONE"
    assert any("--speculative-ddtree-budget" in m and "NONE" in m for m in caplog.messages)


def test_unimplemented_attention_backend(dense):
    one_problem(
        ["--model-path", dense[0], "--attention-backend", "flex"], "--attention-backend", "torch"
    )


def test_bad_choice_on_direct_construction(dense):
    with pytest.raises(ConfigError) as info:
        resolve_server_args(
            ServerArgs(model_path=dense[0], dtype="int8", speculative_algorithm="eagle")
        )
    assert any("--dtype" in p for p in info.value.problems)
    assert any("--speculative-algorithm" in p for p in info.value.problems)


def test_many_problems_in_one_error(tmp_path, dense):
    argv = [
        "--model-path",
        dense[0],
        "--speculative-algorithm",
        "DDTREE",
        "--mem-fraction-static",
        "2",
        "--tp-size",
        "3",
        "--speculative-ddtree-budget",
        "0",
        "--mamba-full-memory-ratio",
        "1.5",
    ]
    problems = problems_of(argv)
    for needle in (
        "--speculative-draft-model-path",
        "--mem-fraction-static",
        "--tp-size",
        "--speculative-ddtree-budget",
        "--mamba-full-memory-ratio",
    ):
        assert any(needle in p for p in problems), needle
    assert str(ConfigError(problems)).count("\n") == len(problems) - 1


def test_budget_auto_resolves_to_the_ladder_under_a_cap(dense, caplog):
    caplog.set_level(logging.INFO, "ddtree")
    args = prepare_server_args(ddtree_argv(dense, "--speculative-ddtree-budget", "AUTO"))
    spec = spec_config(args)
    assert args.speculative_ddtree_budget == "auto" and args.speculative_ddtree_max_budget == 64
    assert spec.adaptive and spec.budget == 64 and spec.verify_width == 65
    assert spec.verify_widths == (1, 9, 16, 17, 33, 65)  # 16: the DFLASH chain rung
    assert any("budget is auto" in m for m in caplog.messages)
    capped = prepare_server_args(
        ddtree_argv(
            dense, "--speculative-ddtree-budget", "auto", "--speculative-ddtree-max-budget", "20"
        )
    )
    assert spec_config(capped).verify_widths == (1, 9, 16, 17, 21)
    fixed = spec_config(prepare_server_args(ddtree_argv(dense, "--speculative-ddtree-budget", "8")))
    assert not fixed.adaptive and fixed.verify_widths == (9,)


def test_budget_auto_nonsense_is_refused_before_weights(dense, capsys):
    with pytest.raises(SystemExit):
        prepare_server_args(ddtree_argv(dense, "--speculative-ddtree-budget", "big"))
    assert "neither an integer nor auto" in capsys.readouterr().err
    one_problem(
        ddtree_argv(
            dense, "--speculative-ddtree-budget", "8", "--speculative-ddtree-max-budget", "4"
        ),
        "--speculative-ddtree-max-budget",
        "auto",
    )
    one_problem(
        ddtree_argv(
            dense, "--speculative-ddtree-budget", "auto", "--speculative-ddtree-max-budget", "0"
        ),
        "--speculative-ddtree-max-budget 0",
    )
    with pytest.raises(ConfigError, match="integer"):
        resolve_server_args(
            ServerArgs(
                model_path=dense[0],
                speculative_algorithm="DDTREE",
                speculative_draft_model_path=dense[1],
                speculative_ddtree_budget="most",
            )
        )


def test_dflash2_tree_is_refused_for_a_dflash_drafter(dense, capsys):
    """--speculative-ddtree-dflash2-tree acts on DFlash2 drafters only (tests/test_dflash2_engine.py
    runs both trees): on a DFlash drafter it is refused before the weights load, a value outside
    path / marginal by the parser."""
    one_problem(
        ddtree_argv(dense, "--speculative-ddtree-dflash2-tree", "marginal"),
        "--speculative-ddtree-dflash2-tree marginal",
        "not DFlash2",
    )
    with pytest.raises(SystemExit):
        prepare_server_args(ddtree_argv(dense, "--speculative-ddtree-dflash2-tree", "unary"))
    assert "marginal" in capsys.readouterr().err


def test_policy_trace_is_refused_where_it_would_trace_nothing(dense, tmp_path, monkeypatch):
    """DDTREE_POLICY_TRACE traces the auto budget policy: with a fixed budget or in a
    directory that does not exist the config is refused before the weights load; with auto and a
    writable place it resolves."""
    monkeypatch.setenv("DDTREE_POLICY_TRACE", str(tmp_path / "trace.jsonl"))
    one_problem(
        ddtree_argv(dense, "--speculative-ddtree-budget", "16"),
        "DDTREE_POLICY_TRACE",
        "--speculative-ddtree-budget auto",
    )
    args = prepare_server_args(ddtree_argv(dense, "--speculative-ddtree-budget", "auto"))
    assert args.speculative_ddtree_budget == "auto"
    monkeypatch.setenv("DDTREE_POLICY_TRACE", str(tmp_path / "no" / "trace.jsonl"))
    one_problem(
        ddtree_argv(dense, "--speculative-ddtree-budget", "auto"),
        "DDTREE_POLICY_TRACE",
        "directory does not exist",
    )


def test_every_flag_is_in_one_group():
    """A field added to ServerArgs without a FLAG_GROUPS entry would have no flag at all."""
    from ddtree.config.args import FLAG_GROUPS, cli_fields

    grouped = [name for names in FLAG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in cli_fields())
