"""The OpenAI API with the real `openai` client against a loopback server: completions and chat, streaming
and not, usage, stops (strings and token ids, cut exactly inside an accepted block), sampling parameters,
/v1/models, /health, /metrics, the `ddtree` extension, the default pair, the launcher and graceful shutdown."""

import importlib.util
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_fixtures import (
    CHARS,
    REPO_ROOT,
    build_constant_pair,
    build_tiny_pair,
    server_argv,
    subprocess_server,
    thread_server,
)

PROMPT = "def add(a, b):"
HAS_TOY_PAIR = importlib.util.find_spec("ddtree.tools.train.toy") is not None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("api_pair")))


@pytest.fixture(scope="module")
def server(pair):
    with thread_server(server_argv(pair, "DDTREE")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60
    )


def collect(stream):
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return chunks, text, finish


def test_models_health_metrics(server, client, pair):
    assert [m.id for m in client.models.list().data] == [pair[0]]
    assert httpx.get(server.base_url + "/health").status_code == 200
    client.completions.create(model=pair[0], prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(server.base_url + "/metrics").text
    for name in (
        "ddtree_requests_total",
        "ddtree_prompt_tokens_total",
        "ddtree_generation_tokens_total",
        "ddtree_generation_throughput_tokens_per_second",
        "ddtree_num_waiting_requests",
        "ddtree_kv_pages_used",
        "ddtree_kv_pages_free",
        "ddtree_state_pool_slots_used",
        'ddtree_spec_rounds_total{algorithm="DDTREE"}',
        'ddtree_accept_length_bucket{algorithm="DDTREE"',
        'ddtree_spec_drafts_total{algorithm="DDTREE"}',
    ):
        assert name in text, name
    # per-position acceptance: depth d's count never exceeds depth d - 1's, nor the drafts
    counts = {}
    for line in text.splitlines():
        if line.startswith('ddtree_spec_accepted_by_depth_total{algorithm="DDTREE",depth="'):
            counts[int(line.split('depth="')[1].split('"')[0])] = float(line.split()[-1])
        if line.startswith('ddtree_spec_drafts_total{algorithm="DDTREE"}'):
            drafts = float(line.split()[-1])
    series = [counts.get(d, 0.0) for d in range(1, max(counts, default=0) + 1)]
    assert drafts > 0 and all(a >= b for a, b in zip([drafts, *series], series))


def test_completion(client, pair):
    r = client.completions.create(
        model=pair[0], prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.model == pair[0]
    assert (
        r.choices[0].finish_reason == "length" and len(r.choices[0].text) == 12
    )  # one char per token
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(PROMPT),
        12,
        len(PROMPT) + 12,
    )
    ext = r.model_extra["ddtree"]
    assert ext["algorithm"] == "DDTREE" and ext["rounds"] >= 1 and ext["mean_accept_length"] >= 1.0

    chunks, text, finish = collect(
        client.completions.create(
            model=pair[0],
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert text == r.choices[0].text and finish == ["length"]
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].model_extra["ddtree"]["mean_accept_length"] == ext["mean_accept_length"]


def test_stream_usage_chunk(client, pair):
    chunks = list(
        client.completions.create(
            model=pair[0],
            prompt=[5, 6, 7],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert (
        last.choices == [] and last.usage.prompt_tokens == 3 and last.usage.completion_tokens == 5
    )
    assert last.usage.total_tokens == 8 and "mean_accept_length" in last.model_extra["ddtree"]


def test_per_request_ddtree_budget(client, pair):
    base = client.completions.create(
        model=pair[0], prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    for budget in (1, 3, 10_000):  # above the server's budget is capped at it
        r = client.completions.create(
            model=pair[0],
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True, "ddtree_budget": budget},
        )
        assert r.choices[0].text == base.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=pair[0], prompt=PROMPT, max_tokens=4, extra_body={"ddtree_budget": 0}
        )
    assert e.value.body["param"] == "ddtree_budget"


def test_chat(client, pair):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(
        model=pair[0], messages=messages, max_tokens=10, temperature=0
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    # the char tokenizer's template: one token per rendered character
    rendered = "[system]be brief\n[user]hello\n[assistant]"
    assert r.usage.prompt_tokens == len(rendered)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= len(r.choices[0].message.content)
    assert r.model_extra["ddtree"]["rounds"] >= 1

    chunks = list(
        client.chat.completions.create(
            model=pair[0],
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == r.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [r.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_strings_and_token_ids(client, pair):
    full = (
        client.completions.create(
            model=pair[0],
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = full[9:11]
    cut = full.index(stop)
    for stops in (stop, [stop, "never-there"]):
        r = client.completions.create(
            model=pair[0],
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stop=stops,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
        _, text, finish = collect(
            client.completions.create(
                model=pair[0],
                prompt=PROMPT,
                max_tokens=24,
                temperature=0,
                stop=stops,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        # held-back prefixes of the stop never leak
        assert text == full[:cut] and finish == ["stop"]
    j = 7
    tok = CHARS.index(full[j])
    first = full.index(full[j])
    r = client.completions.create(
        model=pair[0],
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [tok]},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    # as in vLLM and SGLang, the stop token counts but its text is left out, unless asked for
    assert r.choices[0].text == full[:first]
    for keep in ({"include_stop_str_in_output": True}, {"no_stop_trim": True}):
        r = client.completions.create(
            model=pair[0],
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True, "stop_token_ids": [tok]} | keep,
        )
        assert r.choices[0].text == full[: first + 1], keep


def test_sampling_parameters(client, pair):
    kw = dict(
        model=pair[0],
        prompt=PROMPT,
        max_tokens=16,
        temperature=0.9,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 20, "ignore_eos": True},
    )
    ra = client.completions.create(**kw)
    a, b = ra.choices[0].text, client.completions.create(**kw).choices[0].text
    # seeded sampling is reproducible; 16 tokens (a sampled special token adds no text)
    assert a == b and ra.usage.completion_tokens == 16
    texts = {client.completions.create(**(kw | {"seed": s})).choices[0].text for s in range(4)}
    assert len(texts) > 1
    greedy = (
        client.completions.create(
            model=pair[0],
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    topk1 = (
        client.completions.create(**(kw | {"extra_body": {"top_k": 1, "ignore_eos": True}}))
        .choices[0]
        .text
    )
    assert topk1 == greedy


def test_stop_cut_exactly_inside_an_accepted_block(tmp_path):
    """Every DFLASH round of the constant pair accepts its whole 8-token block; a stop string, stop token or
    max_tokens that ends mid-block still ends the output on exactly that token."""
    pair = build_constant_pair(str(tmp_path))
    with thread_server(server_argv(pair, "DFLASH")) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        full = c.completions.create(model=pair[0], prompt="xyz", max_tokens=20, temperature=0)
        assert full.choices[0].text == "a" * 20
        assert full.model_extra["ddtree"]["mean_accept_length"] > 5
        r = c.completions.create(
            model=pair[0], prompt="xyz", max_tokens=20, temperature=0, stop="aaa"
        )
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (
            "",
            "stop",
            3,
        )
        r = c.completions.create(model=pair[0], prompt="xyz", max_tokens=5, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason) == ("aaaaa", "length")
        _, text, finish = collect(
            c.completions.create(
                model=pair[0],
                prompt="xyz",
                max_tokens=20,
                temperature=0,
                stop=["ab", "aaaa"],
                stream=True,
            )
        )
        assert (text, finish) == ("", ["stop"])


def in_block_stop(llm, prompt, out):
    """(stop string, token index j) such that j sits strictly inside a round's accepted block and the stop's
    first occurrence in the output text completes on token j; None if there is no such token."""
    from ddtree.engine.outputs.detokenizer import IncrementalDetokenizer

    inside, pos = [], 1  # output token 0 comes from prefill, rounds start at 1
    for n in out.accept_lengths:
        # neither the first nor the last token of the round
        inside += list(range(pos + 1, pos + n - 1))
        pos += n
    detok, ends, pieces = IncrementalDetokenizer(llm.tokenizer, prompt), [], []
    for tok in out.token_ids:  # the engine's own incremental text, token by token
        pieces.append(detok.append(tok))
        ends.append(sum(map(len, pieces)))
    for j in inside:
        stop = pieces[j].strip()
        first = out.text.find(stop) if stop else -1
        if first >= 0 and next(k for k, e in enumerate(ends) if e >= first + len(stop)) == j:
            return stop, j
    return None


@pytest.mark.skipif(
    not HAS_TOY_PAIR, reason="ddtree.tools.train.toy (the trained toy pair) is not available yet"
)
def test_stop_inside_accepted_block_on_toy_pair(toy_pair):
    """The toy pair really accepts drafts: pick a stop string that completes strictly inside an accepted DDTREE
    block (found offline with the same engine) and check the server cuts the output exactly there."""
    from engine_utils import make_llm, toy_prompts

    from ddtree import SamplingParams

    llm = make_llm(toy_pair, "DDTREE", speculative_ddtree_budget=16)
    prompt = list(toy_prompts()[2])
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
    found = in_block_stop(llm, prompt, ref)
    assert found, f"no stop candidate inside an accepted block: {ref.accept_lengths}"
    stop, j = found
    with thread_server(server_argv(toy_pair, "DDTREE", "--speculative-ddtree-budget", "16")) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        kw = dict(
            model=toy_pair[0],
            prompt=prompt,
            max_tokens=48,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        full = c.completions.create(**kw)
        assert (
            full.choices[0].text == ref.text
            and full.model_extra["ddtree"]["mean_accept_length"] > 2
        )
        r = c.completions.create(**kw, stop=stop)
        expected = ref.text[: ref.text.find(stop)]
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
        assert r.usage.completion_tokens == j + 1
        _, text, finish = collect(c.completions.create(**kw, stop=[stop], stream=True))
        assert (text, finish) == (expected, ["stop"])


def test_config_errors_exit_2_before_loading_weights(tmp_path, capsys):
    from ddtree.server.launch import main

    assert (
        main(["--model-path", str(tmp_path / "missing"), "--speculative-algorithm", "DDTREE"]) == 2
    )
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: invalid configuration:")]
    assert any("--model-path" in ln for ln in lines) and any(
        "--speculative-draft-model-path" in ln for ln in lines
    )
    assert (
        main(["--model-path", "/no-such-model-dir"]) == 2
    )  # one slash: looks like a repo id, is not one
    assert "/no-such-model-dir: directory does not exist" in capsys.readouterr().err
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddtree.launch_server",
            "--model-path",
            str(tmp_path),
            "--port",
            "0",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "error: invalid configuration: --port 0" in proc.stderr
    assert (
        f"error: invalid configuration: --model-path {tmp_path}: has no config.json" in proc.stderr
    )


def test_default_pair_when_no_model_path(pair, monkeypatch):
    import ddtree.assets

    monkeypatch.setattr(ddtree.assets, "default_model_paths", lambda: pair)
    argv = [
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--speculative-algorithm",
        "DDTREE",
        "--enable-metrics",
    ]
    with thread_server(argv) as srv:
        assert srv.engine.args.model_path == pair[0]
        assert srv.engine.args.speculative_draft_model_path == pair[1]
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in c.models.list().data] == [pair[0]]
        r = c.completions.create(model=pair[0], prompt=PROMPT, max_tokens=4, temperature=0)
        assert r.model_extra["ddtree"]["algorithm"] == "DDTREE"


def test_launch_server_module_serves_and_drains_on_sigterm(pair):
    """`python -m ddtree.launch_server`: SIGTERM while a stream is in flight lets that stream finish, then the
    process exits 0."""
    with subprocess_server(server_argv(pair, "DDTREE")) as (url, proc):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        got, signalled = {"chunks": [], "after": 0}, threading.Event()

        def consume():
            for chunk in c.completions.create(
                model=pair[0],
                prompt="x",
                max_tokens=400,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                got["chunks"].append(chunk)
                got["after"] += signalled.is_set()

        t = threading.Thread(target=consume)
        t.start()
        while not got["chunks"]:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        signalled.set()
        t.join(120)
        assert proc.wait(60) == 0
        text = "".join(ch.choices[0].text for ch in got["chunks"] if ch.choices)
        assert len(text) == 400 and got["chunks"][-1].choices[0].finish_reason == "length"
        assert got["after"] > 0, (
            "the request finished before SIGTERM arrived; the drain was not exercised"
        )


def test_stop_holdback_keeps_back_only_possible_stop_prefixes():
    from ddtree.server.async_engine import stop_holdback

    assert stop_holdback("abcab", ("abd",)) == 2
    assert stop_holdback("xyz", ("zz", "yzq")) == 2
    assert stop_holdback("hello", ()) == 0 and stop_holdback("hello", ("x",)) == 0
    assert stop_holdback("ab", ("ab",)) == 0  # a complete stop has already finished the request
