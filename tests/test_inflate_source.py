"""`--model-path inflate:<shape>`: the inflated pair built in memory by the engine (no files), at the
tiny hybrid shape on the CPU. Its outputs equal the written-and-loaded pair's through the offline
API and the server; it resolves (and check-config plans it) before any weight exists; bad specs are
refused with the flag named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest
import torch
from engine_utils import mean_accept
from inflate_fixtures import PROMPTS, shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOL = dict(max_total_tokens=1024, max_running_requests=4)
ALGOS = {"DFLASH": {}, "DDTREE": {"speculative_ddtree_budget": 8}}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "hybrid.json"
    path.write_text(json.dumps(shape("hybrid")))
    return f"inflate:{path}"


@pytest.fixture(scope="module")
def written(spec, tmp_path_factory):
    """The same inflation written to disk: (target_dir, drafter_dir)."""
    from ddtree.assets import default_model_paths
    from ddtree.tools.inflate import inflate_pair, write_pair

    pair = inflate_pair(*default_model_paths(), spec.removeprefix("inflate:"), dtype=torch.float32)
    return write_pair(pair, str(tmp_path_factory.mktemp("written")))


def _generate(target, drafter, algorithm):
    from ddtree import LLM, SamplingParams

    kw = dict(ALGOS[algorithm])
    if drafter is not None:
        kw["speculative_draft_model_path"] = drafter
    llm = LLM(target, speculative_algorithm=algorithm, dtype="float32", device="cpu", **POOL, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm, llm.generate(list(PROMPTS[:2]), params)


@pytest.fixture(scope="module")
def written_outputs(written):
    return {a: [o.token_ids for o in _generate(*written, a)[1]] for a in ALGOS}


def test_resolves_from_the_plan(spec, written):
    from ddtree.assets import default_model_paths
    from ddtree.config import ServerArgs, resolve_server_args
    from ddtree.models.configs import DrafterConfig, TargetConfig

    a = resolve_server_args(
        ServerArgs(model_path=spec, speculative_algorithm="DDTREE", device="cpu")
    )
    # the written pair is float32; the spec's configs name bfloat16 (what the H200 serves)
    bf16 = dict(dtype="bfloat16")
    assert a.target_config == replace(TargetConfig.from_path(written[0]), **bf16)
    assert a.drafter_config == replace(DrafterConfig.from_path(written[1]), **bf16)
    assert a.speculative_draft_model_path == spec  # the pair's own drafter
    assert a.tokenizer_path == default_model_paths()[0]  # the source target's tokenizer
    assert a.target_config.is_hybrid


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(model_path="inflate:"), "--model-path inflate:: 'inflate:' is not inflate:<shape>"),
        (dict(model_path="inflate:a:b"), "is not inflate:<shape>[:<src_target>:<src_drafter>]"),
        (dict(model_path="inflate:qwen3-9b"), "--model-path inflate:qwen3-9b: --shape"),
        (
            dict(model_path="inflate:qwen3-8b:/no/t:/no/d"),
            "--model-path inflate:qwen3-8b:/no/t:/no/d: ",
        ),
        (
            dict(model_path="inflate:qwen3-8b", speculative_draft_model_path="/x"),
            "--speculative-draft-model-path /x: an inflated pair is served with its own drafter",
        ),
        (
            dict(speculative_draft_model_path="inflate:qwen3-8b"),
            "--speculative-draft-model-path inflate:qwen3-8b: an inflated pair",
        ),
        (
            dict(model_path="inflate:qwen3-8b", tp_size=2),
            "--model-path inflate:qwen3-8b: an inflate: pair is built whole on one device",
        ),
    ],
)
def test_bad_specs_are_refused_before_weights(kw, needle):
    from ddtree.config import ServerArgs, resolve_server_args
    from ddtree.models.configs import ConfigError

    with pytest.raises(ConfigError) as e:
        resolve_server_args(ServerArgs(speculative_algorithm="DFLASH", device="cpu", **kw))
    assert any(needle in p for p in e.value.problems), e.value.problems


def test_too_small_shape_is_refused_before_weights(tmp_path):
    from ddtree.config import ServerArgs, resolve_server_args
    from ddtree.models.configs import ConfigError

    bad = shape("hybrid")
    bad["hidden_size"] = 256
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="hidden_size 256 is smaller than the source's 384"):
        resolve_server_args(ServerArgs(model_path=f"inflate:{path}", device="cpu"))


def test_check_config_plans_the_built_weights(spec, tmp_path):
    """The plan's weight bytes (from the shape) are what the engine builds; and check-config stays
    torch-free on an inflate: path."""
    from ddtree.config import ServerArgs, resolve_server_args
    from ddtree.config.memory_plan import memory_plan
    from ddtree.engine.setup import module_bytes
    from ddtree.tools.inflate.source import build_pair

    args = resolve_server_args(
        ServerArgs(model_path=spec, speculative_algorithm="DFLASH", device="cpu", dtype="bfloat16")
    )
    plan = memory_plan(args, 8 << 30)
    target, drafter = build_pair(spec, True, torch.bfloat16, torch.device("cpu"))
    assert plan.target_weight_bytes == module_bytes(target)
    assert plan.drafter_weight_bytes == module_bytes(drafter)
    code = (
        "import sys; from ddtree.config.check_config import main; "
        "rc = main(['--model-path', 'inflate:qwen3.6-27b', '--speculative-algorithm', 'DDTREE', "
        "'--device', 'cuda', '--device-memory-gib', '140', '--mamba-scheduler-strategy', "
        "'no_buffer']); assert rc == 0, rc; assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "target weights       26.90 B params" in out.stdout


@pytest.mark.parametrize("algorithm", list(ALGOS))
def test_offline_equals_written_pair(spec, written_outputs, algorithm):
    llm, outs = _generate(spec, None, algorithm)
    assert [o.token_ids for o in outs] == written_outputs[algorithm]
    assert llm.engine.runner.target.config.is_hybrid
    assert mean_accept(outs) > 2  # drafts really accepted


def test_server_equals_written_pair(spec, written_outputs):
    from server_fixtures import thread_server

    from ddtree.assets import default_model_paths
    from ddtree.engine.setup import load_tokenizer

    tok = load_tokenizer(default_model_paths()[0])
    argv = ["--model-path", spec, "--device", "cpu", "--dtype", "float32"]
    argv += ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "8"]
    argv += ["--max-total-tokens", "1024", "--max-running-requests", "4"]
    with thread_server(argv) as srv:
        got = []
        for prompt in PROMPTS[:2]:
            ids = tok.encode(prompt, add_special_tokens=False)
            body = {
                "input_ids": ids,
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                },
            }
            r = httpx.post(srv.base_url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            got.append(r.json()["output_ids"])
        info = httpx.get(srv.base_url + "/get_model_info", timeout=10).json()
    assert got == written_outputs["DDTREE"]
    assert info["model_path"] == spec
