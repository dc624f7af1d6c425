"""One derivation: ServerArgs -> SpecConfig / PoolPlan / RunnerConfig, and the memory plan's numbers
are what the engine allocates. Flags that do not act yet are refused before weights load."""

import ast
import pathlib

import pytest
import torch
from hybrid_fixtures import save_hf_qwen3_5
from pair_fixtures import save_random_drafter

import ddtree.engine.setup as setup
from ddtree.config import prepare_server_args
from ddtree.config.memory_plan import memory_plan
from ddtree.engine.config import (
    GDNGeometry,
    SpecConfig,
    pages_per_request,
    plan_pools,
    scratch_pages,
    spec_config,
    verify_width,
)
from ddtree.models.configs import ConfigError

GIB = 2**30
DEVICE_BYTES = 3 * GIB


def embedded(*flags):
    return prepare_server_args(["--device", "cpu", *flags])


def test_verify_width_is_the_tree_the_engine_verifies():
    # DDTREE verifies root + budget nodes whatever the block: budget 8, block 16 -> 9 (not max(16,
    # 9))
    assert verify_width("DDTREE", 16, 8) == 9 and verify_width("DDTREE", 16, 64) == 65
    assert verify_width("DFLASH", 16, 0) == 16 and verify_width("NONE", 1, 0) == 1
    spec = spec_config(
        embedded("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "8")
    )
    assert spec == SpecConfig("DDTREE", 16, 8, 8, False) and spec.verify_width == 9
    assert spec_config(embedded()) == SpecConfig("NONE", 1, 0, 0, False)
    dflash = spec_config(embedded("--speculative-algorithm", "DFLASH"))
    assert (dflash.block_size, dflash.budget, dflash.verify_width) == (16, 0, 16)


@pytest.mark.parametrize(
    "flags",
    [
        ("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "8"),
        ("--speculative-algorithm", "DFLASH"),
        ("--max-total-tokens", "1000", "--page-size", "32"),
    ],
)
def test_memory_plan_is_what_the_engine_allocates(flags, monkeypatch):
    args = embedded(*flags)
    plan = memory_plan(args, device_bytes=DEVICE_BYTES)
    monkeypatch.setattr(setup, "device_bytes", lambda device: DEVICE_BYTES)
    runner, ctx = setup.build_runner(args, torch.device("cpu"))
    cfg, p = runner.cfg, args.page_size
    assert setup.module_bytes(runner.target, runner.drafter) == plan.weight_bytes_per_device
    assert (
        cfg.num_pages == runner.bm.num_pages == plan.num_pages
        and plan.kv_tokens == plan.num_pages * p
    )
    assert cfg.max_verify_width == plan.verify_width == spec_config(args).verify_width
    assert runner.kv.k.shape[1] == (plan.num_pages + scratch_pages(plan.verify_width, p)) * p
    assert runner.bm.max_pages_per_req == pages_per_request(ctx, plan.verify_width, p)
    assert cfg.max_running_requests == plan.max_running_requests and ctx == plan.context_length
    assert cfg.block_size == spec_config(args).block_size
    kv_bytes = runner.kv.bytes + (runner.draft_kv.bytes if runner.draft_kv is not None else 0)
    assert kv_bytes == runner.kv.k.shape[1] * plan.kv_bytes_per_token_per_device
    assert kv_bytes == plan.kv_pool_bytes  # the figure check-config prints is the allocation
    assert plan.state_pool_bytes == 0 and runner.state_pool is None


@pytest.mark.parametrize(
    "flags, names",
    [
        # weights + verify buffers over the static pool: the draft graph's OOM at start-up before
        (("--mem-fraction-static", "0.005"), "--mem-fraction-static"),
        (("--speculative-algorithm", "DFLASH", "--max-running-requests", "4096"), "running"),
    ],
)
def test_a_plan_that_cannot_fit_is_refused_before_anything_loads(flags, names, monkeypatch):
    """The engine plans from the configs' weight bytes first: a plan the device cannot hold is a
    ConfigError naming the fix, and no weight is read (the loaders would raise)."""
    args = embedded(*flags)
    monkeypatch.setattr(setup, "device_bytes", lambda device: DEVICE_BYTES)

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the plan was checked")

    monkeypatch.setattr(setup, "load_target", no_load)
    monkeypatch.setattr(setup, "load_drafter", no_load)
    monkeypatch.setattr(setup, "sourced_models", no_load)
    with pytest.raises(ConfigError) as e:
        setup.build_runner(args, torch.device("cpu"))
    msg = str(e.value)
    assert "the memory plan does not fit" in msg and names in msg and "static pool" in msg
    assert msg.count("\n") <= 1  # one line (the error's own header aside)


def test_the_plan_printed_is_the_pool_allocated_on_this_host():
    """check-config's KV figure on the real host (where the CPU's KV cap binds, and with
    --max-total-tokens) is what the engine allocates and what its log line says, not the room."""
    for flags in [(), ("--max-total-tokens", "64")]:
        args = embedded("--speculative-algorithm", "DFLASH", *flags)
        plan = memory_plan(args)
        runner, _ = setup.build_runner(args, torch.device("cpu"))
        kv_bytes = runner.kv.bytes + runner.draft_kv.bytes
        assert kv_bytes == plan.kv_pool_bytes < plan.kv_room_bytes
        assert plan.kv_limit != "memory" and plan.kv_limit in plan.format()
        assert f"KV pool              {kv_bytes / 2**30:.2f} GiB" in plan.format() or (
            f"{kv_bytes / 2**20:.1f} MiB -> {plan.kv_tokens:,} tokens" in plan.format()
        )


def test_max_total_tokens_rounds_up_to_pages():
    plan = memory_plan(
        embedded("--max-total-tokens", "1000", "--page-size", "32"), device_bytes=DEVICE_BYTES
    )
    assert plan.num_pages == 32 and plan.kv_tokens == 1024


@pytest.fixture(scope="module")
def random_hybrid_pair(tmp_path_factory):
    """A tiny random-weight hybrid target and drafter (no training: sizes only)."""
    root = tmp_path_factory.mktemp("hybrid")
    target, drafter = str(root / "target"), str(root / "drafter")
    save_hf_qwen3_5(target)
    save_random_drafter(target, drafter)
    return target, drafter


def test_state_pool_rows_cap_concurrency(random_hybrid_pair, monkeypatch):
    """--max-mamba-cache-size acts: the engine's state pool has that many rows and admits no more
    requests."""
    target, drafter = random_hybrid_pair
    args = prepare_server_args(
        [
            "--model-path",
            target,
            "--speculative-draft-model-path",
            drafter,
            "--device",
            "cpu",
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-ddtree-budget",
            "4",
            "--max-mamba-cache-size",
            "3",
        ]
    )
    plan = memory_plan(args, device_bytes=DEVICE_BYTES)
    assert plan.state_pool_requests == 3 and any(
        "concurrency is capped" in w for w in plan.warnings
    )
    monkeypatch.setattr(setup, "device_bytes", lambda device: DEVICE_BYTES)
    runner, _ = setup.build_runner(args, torch.device("cpu"))
    pool = runner.state_pool
    assert (
        runner.cfg.max_running_requests == 3
        and pool.conv.shape[1] == 3 + 1  # + the scratch row of padded graph rows
        and runner.bm.num_pages == plan.num_pages
    )
    assert pool.state_bytes == 4 * plan.state_bytes_per_request
    assert pool.stash_bytes == 4 * plan.spec_state_bytes_per_request
    ck = runner.checkpoints.bytes if runner.checkpoints is not None else 0
    assert pool.bytes + ck == plan.state_pool_bytes  # the plan's state figure is the allocation
    assert plan.spec_state_bytes_per_request == GDNGeometry.from_config(
        args.target_config
    ).stash_bytes(5, args.mamba_scheduler_strategy, args.mamba_ssm_dtype, args.dtype)


def test_plan_pools_splits_the_static_pool(random_hybrid_pair):
    target, drafter = random_hybrid_pair
    args = prepare_server_args(
        [
            "--model-path",
            target,
            "--speculative-draft-model-path",
            drafter,
            "--device",
            "cpu",
            "--speculative-algorithm",
            "DDTREE",
            "--mamba-full-memory-ratio",
            "0.5",
        ]
    )
    pools = plan_pools(args, 10 * GIB, GIB, "cuda")
    rest = pools.static_bytes - GIB - pools.workspace_bytes
    assert (
        pools.state_room_bytes == int(rest * 0.5 / 1.5)
        and pools.kv_room_bytes == rest - pools.state_room_bytes
    )
    assert pools.state_rows + 1 == pools.state_room_bytes // (
        pools.state_bytes_per_request + pools.spec_state_bytes_per_request
    )


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (
            # the embedded pair's 6 heads do not split 4 ways (tp 2 acts: tests/test_tp_engine.py)
            {"tp_size": 4},
            ("--tp-size 4", "target attention heads (6)", "valid --tp-size values: [1, 2]"),
        ),
        (
            {"kv_cache_dtype": "bfloat16"},
            ("--kv-cache-dtype bfloat16", "--dtype float32", "--kv-cache-dtype float32"),
        ),
    ],
)
def test_flags_that_do_not_act_are_refused_before_weights_load(kwargs, needles, monkeypatch):
    from ddtree.llm import LLM

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the config was refused")

    monkeypatch.setattr(setup, "load_target", no_weights)
    with pytest.raises(ConfigError) as e:
        LLM(device="cpu", **kwargs)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_unchunked_prefill_acts():
    """--chunked-prefill-size -1 takes a whole prompt in one step (it used to admit nothing)."""
    from ddtree.engine.scheduling.request import SamplingParams
    from ddtree.llm import LLM

    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    # 37 tokens: one chunk of the default 2048
    one_chunk = LLM(device="cpu").generate(prompt, params)[0]
    whole = LLM(device="cpu", chunked_prefill_size=-1)
    engine = whole.engine
    # -1: no chunking, so one prefill batch is capped by --max-prefill-tokens alone
    assert engine.scheduler.prefill_budget == min(engine.max_context, whole.args.max_prefill_tokens)
    out = whole.generate(prompt, params)[0]
    assert (
        out.token_ids == one_chunk.token_ids
        and len(out.token_ids) == 4
        and out.finish_reason == "length"
    )


def test_kv_len_has_one_owner():
    """Only the runner writes Req.kv_len (bench/ fakes contexts)."""
    root = pathlib.Path(__file__).resolve().parent.parent / "ddtree"
    writers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            if isinstance(node, (ast.Assign, ast.AugAssign)) and any(
                isinstance(t, ast.Attribute) and t.attr == "kv_len" for t in targets
            ):
                writers.add(path.relative_to(root).as_posix())
    assert writers - {"bench/rounds.py"} == {"engine/model_runner.py"}
    assert "engine/model_runner.py" in writers


def test_plan_reserves_checkpoint_rows_unless_the_cache_is_off(random_hybrid_pair):
    """Hybrid prefix cache: state checkpoints take the state pool's rows the running requests leave
    (so --mamba-full-memory-ratio governs them), at least one per running request; none with
    --disable-radix-cache."""
    target, drafter = random_hybrid_pair
    base = ["--model-path", target, "--device", "cpu", "--max-running-requests", "4"]
    gib = 2**30
    on = plan_pools(prepare_server_args(base), 10 * gib, gib, "cuda")
    off = plan_pools(prepare_server_args(base + ["--disable-radix-cache"]), 10 * gib, gib, "cuda")
    assert on.checkpoint_rows > 0 and on.checkpoint_bytes == on.checkpoint_rows * (
        on.state_bytes_per_request
    )
    assert off.checkpoint_rows == 0
    per = on.state_bytes_per_request + on.spec_state_bytes_per_request
    spare = on.state_room_bytes - (4 + 1) * per  # 4 running requests and the scratch row
    assert on.checkpoint_rows == min(spare // on.state_bytes_per_request, on.num_pages)
    # a state pool pinned at 6 requests (+ the scratch row) has room for their 6 checkpoints
    # too (tests/test_hybrid_prefix_checkpoints.py): 4 running leave 2 rows + those 6
    assert per == on.state_bytes_per_request  # no speculation: no stash
    pinned = plan_pools(
        prepare_server_args(base + ["--max-mamba-cache-size", "6"]), 10 * gib, gib, "cuda"
    )
    assert (pinned.state_rows, pinned.max_running_requests, pinned.checkpoint_rows) == (6, 4, 8)
    text = memory_plan(prepare_server_args(base), 10 * gib).format()
    assert "state checkpoints" in text
