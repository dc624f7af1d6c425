"""The differential fuzzer through the real HTTP server (issue 39): a few hundred requests at once
against a uvicorn server in this process - /v1/completions, /v1/chat/completions and /generate,
streaming and not, `n`, log-probs, stop strings and ids drawn from the model's own continuations,
greedy and seeded samples, clients that disconnect mid-stream or give up on a response - then every
greedy answer against the AR reference cut by the stop-rule oracle (tests/fuzz_oracle.py), every
sampled one against its own tokens where the route returns them, seeded twins against each other
(under `auto` too: sampling is keyed by seed and position), and the drained server clean:
nothing running, every slot and page available, the engine's integrity whole (read on the engine
thread), and every cached page / checkpoint equal to a fresh prefill of its tokens.

    PYTHONPATH=. python3 tests/fuzz_http.py --seed 3 --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

ROUTES = ("completions", "chat", "generate")


@dataclasses.dataclass
class Call:
    route: str
    stream: bool
    body: dict
    prompt: tuple[int, ...]  # the engine's prompt ids
    params: object  # the engine's SamplingParams (for the oracle)
    n: int
    disconnect: int | None = None  # stream: events read before closing; else: ms until giving up
    twin_of: int | None = None
    pathological: tuple[str, str] | None = None  # (kind, source): a slow grammar (PATHOLOGICAL)
    reasoning: bool = False  # the reasoning parser splits the answer (none may appear)
    refused: str | None = None  # a nested-JSON call: the 400 names this field


@dataclasses.dataclass
class Choice:
    text: str
    reason: str | None
    ids: list[int] | None = None  # /generate only
    matched: object = None  # /generate only
    tokens: int | None = None  # completion tokens, where the route says per choice
    logprobs: list[float] | None = None
    usage: int | None = None  # OpenAI bodies: the response's completion tokens (all choices)


def _deep_schema(depth: int) -> str:
    s: dict = {"type": "string", "maxLength": 3}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return json.dumps(s)


# pathological grammars beside plain traffic (issue 54): a few calls of a case carry a grammar
# whose masks grow slower with every token or whose schema is deep; each must end as a
# `grammar_too_complex` error or as text its grammar accepts, while every plain call beside it still
# answers what AR answers and the server drains clean (a request its budget failed leaks nothing).
# Drawn from a stream of their own, after the plain calls: a seed's plain calls are unchanged.
PATHOLOGICAL = (
    ("regex", "(.{1,50}){1,50}"),
    ("regex", "(([0-9]|[1-9][0-9]){1,20}){1,20}"),
    ("json_schema", _deep_schema(40)),
)
PATHOLOGICAL_CALLS = (0, 1, 2, 3)  # drawn per case
# the mask budgets of a case with pathological calls: small, so that fills over the toy's 64
# words reach them (the product's are for real vocabularies)
FUZZ_MASK_BUDGET = {"round_s": 0.005, "total_s": 0.05}


# the seed picks the server: seed % 4 -> (target, algorithm, budget)
SERVERS = (
    ("dense", "DDTREE", "fixed"),
    ("dense", "DFLASH", None),
    ("dense", "DDTREE", "auto"),
    ("hybrid", "DDTREE", "fixed"),
)


def server_argv(pairs, seed: int, rng: random.Random) -> tuple[str, list[str]]:
    """(target, flags) of the seed's server: small pages and pool, a few running slots."""
    target, algorithm, budget = SERVERS[seed % len(SERVERS)]
    pair = pairs[target]
    argv = ["--model-path", pair[0], "--device", "cpu", "--dtype", "float32", "--enable-metrics"]
    # every server can split reasoning; each call asks for it or not (answers have no think block,
    # so the split answer must be the no-parser text byte for byte, with no reasoning)
    argv += ["--reasoning-parser", "qwen3"]
    argv += ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", pair[1]]
    if budget is not None:
        b = "auto" if budget == "auto" else str(rng.choice([4, 8, 16]))
        argv += ["--speculative-ddtree-budget", b]
    if target == "hybrid":
        argv += ["--mamba-scheduler-strategy", rng.choice(["extra_buffer", "no_buffer"])]
    argv += ["--page-size", str(rng.choice([2, 4, 8])), "--random-seed", str(seed)]
    argv += ["--max-running-requests", str(rng.choice([4, 8, 16]))]
    argv += ["--chunked-prefill-size", str(rng.choice([8, 32, 2048]))]
    argv += ["--max-total-tokens", str(rng.choice([256, 512, 4096]))]
    return target, argv


def draw_calls(rng: random.Random, n_calls: int, refs, target: str, block: int) -> list[Call]:
    from fuzz_oracle import TextOf
    from fuzz_workload import draw_params, draw_prompts

    tok = refs.tokenizer(target)
    text_of = TextOf(tok)
    # half without <|bos|>: those can be sent as text (the tokenizer has no text for it)
    prompts = [
        p[1:] if rng.random() < 0.5 and len(p) > 1 else p
        for p in draw_prompts(rng, n_calls, refs, target)
    ]
    conts = refs.get(target, prompts)
    knobs = {"block": block, "budget": 8, "fixed": False}
    calls: list[Call] = []
    # the dimensions added later draw from their own stream: the earlier ones' draws stay the same
    extra = random.Random(hash(rng.getstate()))  # seeded without a draw from rng
    for prompt in prompts:
        sp = draw_params(rng, prompt, conts[prompt], text_of, knobs, "DFLASH")
        route = rng.choice(ROUTES)
        n = rng.choice([1, 1, 1, 2, 3])
        stream = rng.random() < 0.5
        calls.append(_call(route, stream, prompt, sp, n, tok, rng))
        if route != "completions" and extra.random() < 0.5:
            calls[-1].reasoning = True
            calls[-1].body["separate_reasoning"] = True
        elif route == "chat":
            calls[-1].body["separate_reasoning"] = False
        if rng.random() < 0.12:  # the client goes away mid-stream, or gives up on the answer
            calls[-1].disconnect = rng.randint(1, 4) if stream else rng.randint(1, 200)
        elif sp.seed is not None and rng.random() < 0.3:
            calls.append(dataclasses.replace(calls[-1], twin_of=len(calls) - 1))
    return calls


def draw_pathological(rng: random.Random, calls: list[Call], tok) -> list[Call]:
    """A few calls with a PATHOLOGICAL grammar, each on a plain call's prompt (greedy, n = 1)."""
    from ddtree import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=24)
    out = []
    for _ in range(rng.choice(PATHOLOGICAL_CALLS)):
        kind, source = rng.choice(PATHOLOGICAL)
        base = rng.choice(calls)
        route, stream = rng.choice(ROUTES), rng.random() < 0.5
        body = {"temperature": 0, "stream": stream}
        grammar = {"regex": source} if kind == "regex" else {"json_schema": source}
        text = tok.decode(list(base.prompt))
        if route == "generate":
            body |= {"input_ids": list(base.prompt)}
            body["sampling_params"] = {"temperature": 0, "max_new_tokens": 24} | grammar
            del body["temperature"]
        else:
            body |= {"max_tokens": 24} | grammar
            if route == "chat":
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = list(base.prompt)
        out.append(Call(route, stream, body, base.prompt, sp, 1, pathological=(kind, source)))
    return out


DEEP = "[" * 3000 + "]" * 3000  # over MAX_JSON_DEPTH and Python's recursion limit
ARGS = {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}}
# (route, field the 400 names, body): JSON nested in a string the server parses itself
NESTED = (
    ("completions", "json_schema", {"prompt": "a", "json_schema": DEEP}),
    ("completions", "guided_json", {"prompt": "a", "guided_json": DEEP}),
    ("chat", "structured_outputs.json", {"structured_outputs": {"json": DEEP}}),
    (
        "chat",
        "messages.1.tool_calls.0.function.arguments",
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "tool_calls": [ARGS]},
            ]
        },
    ),
    (
        "generate",
        "sampling_params.json_schema",
        {"text": "a", "sampling_params": {"json_schema": DEEP}},
    ),
)


def nested_json_calls(rng: random.Random, k: int) -> list[Call]:
    """k calls whose JSON-in-a-string field nests too deep: each must be a 400 naming it, sent
    beside the plain traffic."""
    out = []
    for _ in range(k):
        route, param, body = rng.choice(NESTED)
        if route == "chat" and "messages" not in body:
            body = body | {"messages": [{"role": "user", "content": "a"}]}
        body = body | {"stream": rng.random() < 0.5}
        out.append(Call(route, body["stream"], body, (), None, 1, refused=param))
    return out


def _call(route, stream, prompt, sp, n, tok, rng) -> Call:
    text = tok.decode(list(prompt))
    as_text = rng.random() < 0.5 and tok.encode(text, add_special_tokens=False) == list(prompt)
    common = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k}
    if sp.seed is not None:
        common["seed"] = sp.seed
    if not sp.skip_special_tokens:  # the detokenisation fields, where not their defaults
        common["skip_special_tokens"] = False
        common["spaces_between_special_tokens"] = sp.spaces_between_special_tokens
    if route == "generate":
        params = common | {
            "max_new_tokens": sp.max_tokens,
            "stop": list(sp.stop),
            "stop_token_ids": list(sp.stop_token_ids),
            "ignore_eos": sp.ignore_eos,
            "n": n,
        }
        params["sampling_seed"] = params.pop("seed", None)
        if sp.include_stop_str_in_output:
            params["no_stop_trim"] = True  # SGLang's name
        body = {"sampling_params": params, "stream": stream}
        body |= {"text": text} if as_text else {"input_ids": list(prompt)}
        if sp.logprobs:
            body |= {"return_logprob": True, "top_logprobs_num": sp.top_logprobs}
        return Call(route, stream, body, prompt, sp, n)
    body = common | {
        "max_tokens": sp.max_tokens,
        "stop": list(sp.stop),
        "stop_token_ids": list(sp.stop_token_ids),
        "ignore_eos": sp.ignore_eos,
        "n": n,
        "stream": stream,
    }
    if sp.include_stop_str_in_output:
        body["include_stop_str_in_output"] = True
    if route == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        if sp.logprobs:
            body |= {"logprobs": True, "top_logprobs": sp.top_logprobs}
        ids = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        return Call(route, stream, body, tuple(tok.encode(ids, add_special_tokens=False)), sp, n)
    body["prompt"] = text if as_text else list(prompt)
    if sp.logprobs:
        body["logprobs"] = sp.top_logprobs
    return Call(route, stream, body, prompt, sp, n)


URLS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}


async def send(client: httpx.AsyncClient, base: str, call: Call) -> list[Choice] | str | None:
    """The call's choices; a string on an HTTP / protocol error; None when the client gave up."""
    url = base + URLS[call.route]
    if call.disconnect is not None and not call.stream:
        try:
            await asyncio.wait_for(client.post(url, json=call.body), timeout=call.disconnect / 1000)
        except (asyncio.TimeoutError, httpx.HTTPError):
            return None
        return None  # answered before the client gave up: nothing to compare
    if not call.stream:
        r = await client.post(url, json=call.body)
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:300]}"
        return parse_body(call, r.json())
    events = []
    async with client.stream("POST", url, json=call.body) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[6:]))
            if call.disconnect is not None and len(events) >= call.disconnect:
                return None  # leaving the block closes the connection mid-stream
    return parse_stream(call, events)


def parse_body(call: Call, body) -> list[Choice] | str:
    if call.route == "generate":
        items = body if isinstance(body, list) else [body]
        if call.reasoning and any(d.get("reasoning_text") is not None for d in items):
            return f"reasoning_text without a think block: {items}"
        return [_native(d) for d in items]
    out = []
    for c in sorted(body["choices"], key=lambda c: c["index"]):
        text = c["text"] if call.route == "completions" else c["message"]["content"]
        if call.route == "chat" and c["message"].get("reasoning_content") is not None:
            return f"reasoning_content {c['message']['reasoning_content']!r} without a think block"
        out.append(Choice(text, c["finish_reason"], logprobs=_openai_lps(call, c.get("logprobs"))))
    if [c["index"] for c in body["choices"]] != list(range(call.n)):
        return f"choice indices {[c['index'] for c in body['choices']]} for n={call.n}"
    for c in out:  # the usage sums the choices' tokens: each greedy choice has the same count
        c.usage = body["usage"]["completion_tokens"]
    return out


def _native(d: dict) -> Choice:
    fr = d["meta_info"]["finish_reason"]
    lps = d["meta_info"].get("output_token_logprobs")
    return Choice(
        d["text"],
        fr and fr["type"],
        list(d["output_ids"]),
        fr and fr.get("matched"),
        d["meta_info"]["completion_tokens"],
        [e[0] for e in lps] if lps is not None else None,
    )


def _openai_lps(call: Call, lp) -> list[float] | None:
    if lp is None:
        return None
    if call.route == "completions":
        return list(lp["token_logprobs"])
    return [e["logprob"] for e in lp["content"] or ()]


def parse_stream(call: Call, events: list[dict]) -> list[Choice] | str:
    if any("error" in e for e in events):
        return f"stream error: {[e for e in events if 'error' in e][0]}"
    if call.route == "generate":
        last: dict[int, dict] = {}
        for e in events:  # cumulative: each event extends its choice's last one
            i = e.get("index", 0)
            if i in last and not (
                e["text"].startswith(last[i]["text"])
                and e["output_ids"][: len(last[i]["output_ids"])] == last[i]["output_ids"]
            ):
                return f"choice {i}: a cumulative event does not extend the one before: {e}"
            if i in last and last[i]["meta_info"]["finish_reason"] is not None:
                return f"choice {i}: an event after its finish: {e}"
            if call.reasoning and e.get("reasoning_text") is not None:
                return f"choice {i}: reasoning_text without a think block: {e}"
            last[i] = e
        return [_native(last[i]) for i in sorted(last)]
    texts = [""] * call.n
    reasons: list = [None] * call.n
    lps: list = [[] if call.params.logprobs else None for _ in range(call.n)]
    for e in events:
        for c in e.get("choices", ()):
            i = c["index"]
            delta = c.get("text") if call.route == "completions" else c["delta"].get("content")
            if call.route == "chat" and c["delta"].get("reasoning_content"):
                return f"choice {i}: reasoning_content without a think block: {e}"
            texts[i] += delta or ""
            if reasons[i] is not None:
                return f"choice {i}: a chunk after its finish: {e}"
            reasons[i] = c.get("finish_reason")
            more = _openai_lps(call, c.get("logprobs"))
            if more:
                lps[i] += more
    return [Choice(t, r, logprobs=lp) for t, r, lp in zip(texts, reasons, lps)]


def run_http_case(seed: int, refs, n_calls: int = 120, concurrency: int = 24):
    """One seeded server and its calls; returns fuzz_engine's CaseResult."""
    from fuzz_checks import cached_state_problems, check_call, check_pathological
    from fuzz_engine import CaseResult
    from fuzz_oracle import TextOf
    from server_fixtures import thread_server

    from ddtree.engine import integrity

    rng = random.Random(seed)
    t0 = time.perf_counter()
    target, argv = server_argv(refs.pairs, seed, rng)
    shown = argv[argv.index("--speculative-algorithm") :]
    drop = shown.index("--speculative-draft-model-path")
    flags = " ".join(shown[:drop] + shown[drop + 2 :])
    res = CaseResult(seed, f"http {target} {flags}", requests_asked=n_calls)
    with thread_server(argv) as srv:
        engine = srv.engine
        block = engine.spec.block_size
        calls = draw_calls(rng, n_calls, refs, target, block)
        delays = [rng.random() * 0.5 for _ in calls]
        prng = random.Random(seed * 7919 + 54)  # the pathological calls' own stream
        slow = draw_pathological(prng, calls, refs.tokenizer(target))
        if slow:
            for k, v in FUZZ_MASK_BUDGET.items():
                setattr(engine.decoder.mask_workers.budget, k, v)
        calls += slow
        delays += [prng.random() * 0.5 for _ in slow]
        res.requests = sum(c.n for c in calls)
        nested = nested_json_calls(random.Random(hash(rng.getstate())), 3)
        delays += [0.25] * len(nested)
        got = asyncio.run(_send_all(srv.base_url, calls + nested, delays, concurrency))
        got, refusals = got[: len(calls)], got[len(calls) :]
        for call, g in zip(nested, refusals):
            res.stats["http_nested_json_refused"] += 1
            if not (isinstance(g, str) and g.startswith("HTTP 400") and call.refused in g):
                res.failures.append(f"nested JSON in {call.refused} on {call.route}: {g!r:.300}")
        res.stats["http_reasoning_split"] += sum(c.reasoning for c in calls)
        text_of, ctx, eos = TextOf(engine.tokenizer), engine.max_context, engine.emitter.eos_ids
        conts = refs.get(target, [c.prompt for c in calls])
        for i, (call, g) in enumerate(zip(calls, got)):
            if call.pathological is not None:
                bad = check_pathological(call.pathological, g, res.stats)
            else:
                bad = check_call(call, g, conts[call.prompt], text_of, ctx, eos, res.stats)
            tw = call.twin_of  # under auto too: sampling is keyed by (seed, position)
            if tw is not None and not bad and isinstance(got[tw], list) and isinstance(g, list):
                res.stats["http_twins_" + ("auto" if "auto" in argv else "fixed")] += 1
                if [(c.text, c.ids) for c in g] != [(c.text, c.ids) for c in got[tw]]:
                    bad.append(f"seeded twin of call {tw} differs: {g} vs {got[tw]}")
            res.failures += [
                f"call {i} {call.route} {json.dumps(call.body)[:300]}: {b}" for b in bad
            ]
        res.failures += asyncio.run(
            _drained(srv, refs.llm(target), integrity, cached_state_problems, res.stats)
        )
    res.seconds = time.perf_counter() - t0
    return res


async def _send_all(base: str, calls, delays, concurrency: int):
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(call, delay):
            await asyncio.sleep(delay)
            async with sem:
                return await send(client, base, call)

        return await asyncio.gather(*(one(c, d) for c, d in zip(calls, delays)))


async def _drained(srv, ref_llm, integrity, cached_state_problems, stats) -> list[str]:
    """Wait for the server to go idle (aborts of gone clients included), then check it on the
    engine thread: whole, drained, cached pages and checkpoints as a fresh prefill computes."""
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            info = (await client.get(srv.base_url + "/get_server_info")).json()
            if info["num_running_requests"] == 0 and info["num_waiting_requests"] == 0:
                break
            if time.monotonic() > deadline:
                return [f"server not idle 30 s after the last answer: {info}"]
            await asyncio.sleep(0.05)
        metrics = (await client.get(srv.base_url + "/metrics")).text
    aborts = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith('ddtree_requests_total{finish_reason="abort"}')
    ]
    stats["http_server_aborts"] += int(float(aborts[0].split()[-1])) if aborts else 0
    for part in ("sum", "count"):  # tokens per decode round, all requests
        line = [ln for ln in metrics.splitlines() if ln.startswith(f"ddtree_accept_length_{part}")]
        stats[f"http_accept_{part}"] += float(line[0].split()[-1]) if line else 0.0
    bad = []
    if info["kv_integrity"] != "ok":
        bad.append(f"/get_server_info kv_integrity: {info['kv_integrity']}")
    faults = {k: info.get(k) for k in ("requests_failed_alone", "batch_failures", "engine_dead")}
    if any(faults.values()):  # fault isolation hid an exception behind a failed request
        bad.append(f"engine faults: {faults}")
    if info["request_slots_free"] != info["request_slots_total"]:
        bad.append(f"slots leaked: {info}")
    if info["kv_pages_free"] != info["kv_pages_total"]:
        bad.append(f"pages leaked: {info}")
    ref_runner = ref_llm.engine.runner
    engine = srv.engine
    bad += await srv.async_engine.call(
        lambda: (
            integrity.drained_problems(engine, deep=True)
            + cached_state_problems(engine, ref_runner)
        )
    )
    return [f"drained: {b}" for b in bad]


def main(argv=None) -> int:
    from fuzz_engine import summarize, toy_pairs
    from fuzz_oracle import References

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", help="a range a:b of seeds")
    ap.add_argument("--requests", type=int, default=120)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    refs = References(toy_pairs())
    lo, hi = (int(x) for x in a.seeds.split(":")) if a.seeds else (a.seed, a.seed + 1)
    results = []
    for seed in range(lo, hi):
        r = run_http_case(seed, refs, a.requests)
        results.append(r)
        print(r.line().replace("tests/fuzz_engine.py", "tests/fuzz_http.py"), flush=True)
    print(summarize(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
