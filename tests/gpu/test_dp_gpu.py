"""--dp-size on CUDA (issue 45), embedded pair, fp32, DDTREE, CUDA graphs: a `--dp-size 2` server
answers the offline engine's tokens at T=0 (each prompt alone, then all at once, spread over both
replicas), and a replica killed with SIGKILL leaves the other serving (/health "degraded", new
requests 200). On one GPU the two replicas share it (--gpu-id-step 0, --mem-fraction-static 0.3
each); with 2+ GPUs they get one GPU each, and /get_server_info shows where.
`python3 -m pytest -m gpu tests/gpu/test_dp_gpu.py -q -s` (scripts/device/dp.sh runs it)."""

import contextlib
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from engine_utils import mean_accept
from server_fixtures import REPO_ROOT, free_port, server_info, wait_healthy

from ddtree.bench.acceptance import DEFAULT_PROMPTS

PROMPTS = list(DEFAULT_PROMPTS[2:8])  # held-out code the embedded pair's drafter accepts
N_NEW = 32


@pytest.fixture(scope="module")
def reference():
    """The offline engine's tokens, each prompt alone (the server's sequential pass is batch 1)."""
    from ddtree import LLM, SamplingParams
    from ddtree.assets import default_model_paths

    target, drafter = default_model_paths()
    llm = LLM(
        target,
        speculative_algorithm="DDTREE",
        speculative_draft_model_path=drafter,
        device="cuda",
        dtype="float32",
        mem_fraction_static=0.3,
    )
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    outs = [llm.generate([p], params)[0] for p in PROMPTS]
    assert mean_accept(outs) > 2  # the comparison below covers accepted drafts
    tokens = [list(o.token_ids) for o in outs]
    del llm, outs
    gc.collect()  # the engine's graphs and pools, before the server's replicas take the GPU
    torch.cuda.empty_cache()
    return tokens


@contextlib.contextmanager
def server(argv: list[str], timeout: float = 400):
    """`python -m ddtree.launch_server` (its replicas warm up one after another on a shared GPU:
    a cold Triton cache compiles for minutes); its log is printed if it fails to come up."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "ddtree.launch_server", *argv, "--port", str(port)]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=log, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(url, timeout, proc)
            except (RuntimeError, TimeoutError):
                log.seek(0)
                print(log.read()[-4000:])
                raise
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def generate(url: str, prompt: str) -> httpx.Response:
    sp = {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/generate", json={"text": prompt, "sampling_params": sp}, timeout=300)


def test_dp2_matches_the_engine_and_survives_a_dead_replica(reference):
    shared = torch.cuda.device_count() < 2
    place = ["--gpu-id-step", "0", "--mem-fraction-static", "0.3"] if shared else []
    argv = ["--speculative-algorithm", "DDTREE", "--dtype", "float32", "--enable-metrics"]
    argv += ["--dp-size", "2", *place]
    with server(argv + ["--log-level", "warning"]) as url:
        info = server_info(url)
        assert [r["gpus"] for r in info["replicas"]] == ([[0], [0]] if shared else [[0], [1]])
        assert all(r["device"] == "cuda:0" for r in info["replicas"])  # each sees its own GPU
        alone = [generate(url, p) for p in PROMPTS]
        assert [r.json()["output_ids"] for r in alone] == reference
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: generate(url, p), PROMPTS))
        assert [r.json()["output_ids"] for r in together] == reference
        info = server_info(url)
        assert all(r["dispatched"] >= len(PROMPTS) // 2 for r in info["replicas"]), info
        print(
            "dp 2 on",
            "one shared GPU" if shared else "two GPUs",
            "- tokens equal the engine's:",
            len(PROMPTS),
            "prompts alone and together; accept length",
            sum(r.json()["meta_info"]["spec_accept_length"] for r in together) / len(PROMPTS),
        )
        os.kill(info["replicas"][1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=5).text.find("degraded") < 0:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        after = [generate(url, p) for p in PROMPTS[:3]]
        assert [r.json()["output_ids"] for r in after] == reference[:3]
