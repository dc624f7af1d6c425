"""The fuzzer's checks of one finished request (against the AR reference and the stop-rule oracle)
and of an idle engine's cached pages and checkpoints (against a fresh prefill of their tokens)."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass

import torch
from fuzz_oracle import Continuation, TextOf, apply_stop_rule


@dataclass(frozen=True)
class Tolerances:
    # a divergence from AR where the reference's top-2 log-probs are this close is a numerical
    # near-tie
    tie: float = 1e-3
    lp: float = 2e-3  # |log-prob - AR's| at the same position (fp32 on the CPU, batched vs alone)
    kv: float = 1e-3  # cached K / V vs a fresh prefill of the same tokens
    kv_rel: float = 0.0  # ... or this share of the position's largest |K| / |V|, if larger
    state: float = 1e-3  # a hybrid checkpoint vs a fresh prefill's state (relative, and absolute)


FP32 = Tolerances()
# Block FP8 (`quantization=fp8`): each linear rounds its input to e4m3 (3 mantissa bits), so an
# fp32 difference between two paths of the same tokens (prefill vs decode, a verify vs a decode:
# ~1e-7) that crosses a rounding boundary moves that input by up to an eighth, and the cache keeps
# it. FP8 AR alone, the toy pair: a continuation decoded vs the same tokens prefilled, log-probs
# 4.1e-3 apart from the first position past the flip (fp32: 1e-7); a runner-up's log-prob moved
# 0.055 (-4.91 vs -4.97) in one of 200 fuzz cases. A hybrid's recurrent state carries such a flip
# forward, moving every later position's K / V a little (seed 439: 0.112 at a position whose |v|
# reaches 3.04, 29 of its 32 entries moved): the K / V bound is relative too. A cached slot holding
# another token's K / V, or none, is off by its whole magnitude. Exactness is unchanged: the tokens
# must be AR's but for near-ties.
FP8 = Tolerances(tie=5e-2, lp=2e-1, kv=1e-1, kv_rel=1e-1, state=5e-2)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None


def check_request(
    req,
    ref: Continuation | None,
    text_of: TextOf,
    ctx: int,
    eos,
    stats: Counter,
    tol: Tolerances = FP32,
):
    """Problems of one finished request. Greedy: its output is the reference cut by the stop rule
    (an aborted one: a prefix of that); a divergence at a near-tie counts in stats['near_tie'] and
    falls back to the sampled checks. Sampled: its own tokens under the stop rule."""
    p, out = req.params, list(req.output_ids)
    aborted = req.finish_reason == "abort"
    bad: list[str] = []
    own = True
    if p.greedy and ref is not None:
        exp = apply_stop_rule(text_of, req.prompt_ids, ref.tokens, p, ctx, eos)
        if exp.reason is None:
            return [f"harness: reference of {len(ref.tokens)} tokens too short for {p}"]
        k = first_difference(out, exp.tokens)
        if k is not None and ref.gap(k) < tol.tie:
            stats["near_tie"] += 1
        elif k is not None:
            return [
                f"token {k}: {out[k]} where AR has {exp.tokens[k]} (out {out}, AR {exp.tokens})"
            ]
        elif aborted:
            if len(out) > len(exp.tokens):
                bad.append(f"aborted with {len(out)} tokens, past AR's finish at {len(exp.tokens)}")
        else:
            own = False
            if out != exp.tokens:
                bad.append(f"tokens {out} != AR cut by its stop rule {exp.tokens}")
            if req.text != exp.text:
                bad.append(f"text {req.text!r} != expected {exp.text!r}")
            if (req.finish_reason, req.stop_hit) != (exp.reason, exp.matched):
                bad.append(
                    f"finish ({req.finish_reason}, {req.stop_hit!r}) != expected "
                    f"({exp.reason}, {exp.matched!r})"
                )
            bad += _greedy_logprobs(req, ref, tol)
    if own:
        bad += _own_rule(req, text_of, ctx, eos)
        bad += _sampled_logprobs(req)
    return bad


def check_grammar_request(req, ref, stats: Counter, tol: Tolerances = FP32) -> list[str]:
    """A grammar request against AR's run of the same parameters (`ref`: its RequestOutput):
    the same tokens, text and finish (an aborted or failed one: a prefix of AR's tokens); a
    divergence where AR's top-2 log-probs are within `tol.tie` is a near-tie."""
    out, exp = list(req.output_ids), list(ref.token_ids)
    stats["grammar_" + str(req.finish_reason)] += 1
    k = first_difference(out, exp)
    if k is not None:
        top = ref.logprobs[k].top
        if len(top) > 1 and top[0][1] - top[1][1] < tol.tie:
            stats["near_tie"] += 1
            return []
        return [f"grammar: token {k}: {out[k]} where AR has {exp[k]} (out {out}, AR {exp})"]
    if req.finish_reason == "abort" or req.error is not None:
        if len(out) > len(exp):
            return [f"grammar: aborted with {len(out)} tokens, past AR's finish at {len(exp)}"]
        return []
    bad = []
    if out != exp:
        bad.append(f"grammar: tokens {out} != AR's {exp}")
    if req.text != ref.text:
        bad.append(f"grammar: text {req.text!r} != AR's {ref.text!r}")
    if req.finish_reason != ref.finish_reason:
        bad.append(f"grammar: finish {req.finish_reason} != AR's {ref.finish_reason}")
    return bad


def check_seeded_request(req, ref, stats: Counter, tol: Tolerances = FP32) -> list[str]:
    """A seeded sampled request against AR's run of the same parameters (`ref`: its RequestOutput,
    with top log-probs): sampling is keyed by (seed, position) (engine/round/sampler.py), so its tokens
    are AR's whatever the mode, budget, batch or preemption, up to where either stops (the case's
    declared EOS and context are not the reference's; each stop is checked on its own tokens). A
    divergence where the two tokens' perturbed scores (log-prob / T + the position's Gumbel noise)
    are within tol.tie / T is a numerical near-tie."""
    out, exp = list(req.output_ids), list(ref.token_ids)
    stats["seeded_sampled"] += 1
    k = first_difference(out, exp)
    if k is None:
        return []
    gap = _perturbed_gap(req, ref.logprobs[k].top, len(req.prompt_ids) + k, out[k], exp[k])
    if gap < tol.tie / req.params.temperature:
        stats["near_tie"] += 1
        return []
    return [
        f"seeded: token {k}: {out[k]} where AR with the same seed has {exp[k]} (gap {gap:.3g}; "
        f"out {out}, AR {exp})"
    ]


def _perturbed_gap(req, top, position: int, a: int, b: int) -> float:
    """|score(a) - score(b)| at `position` (inf where either is outside AR's top log-probs)."""
    import torch

    from ddtree.engine.round.sampler import gumbel_noise

    lp = dict(top)
    if a not in lp or b not in lp:
        return float("inf")
    g = gumbel_noise(req.params.seed, torch.tensor([position]), max(a, b) + 1)[0]
    t = req.params.temperature
    return abs(lp[a] / t + float(g[a]) - lp[b] / t - float(g[b]))


def _own_rule(req, text_of: TextOf, ctx: int, eos) -> list[str]:
    out, p = list(req.output_ids), req.params
    e = apply_stop_rule(text_of, req.prompt_ids, out, p, ctx, eos)
    if req.finish_reason == "abort":
        if e.reason is not None:
            return [f"aborted, but its tokens finish at {len(e.tokens)} ({e.reason}): {out}"]
        return []
    bad = []
    if e.tokens != out or e.reason != req.finish_reason:
        bad.append(
            f"its own tokens finish at {len(e.tokens)} of {len(out)} ({e.reason}), the engine "
            f"says {req.finish_reason}: {out}"
        )
    elif req.text != e.text or req.stop_hit != e.matched:
        bad.append(f"text {req.text!r} / {req.stop_hit!r} != {e.text!r} / {e.matched!r}")
    if not p.include_stop_str_in_output and any(s in req.text for s in p.stop):
        bad.append(f"a stop string is in the returned text {req.text!r}")
    return bad


def _greedy_logprobs(req, ref: Continuation, tol: Tolerances) -> list[str]:
    if not req.params.logprobs:
        return []
    k = req.params.top_logprobs
    for i, e in enumerate(req.logprobs):
        if e.token_id != req.output_ids[i] or abs(e.logprob - ref.logprobs[i]) > tol.lp:
            return [f"log-prob {i}: {e} vs AR's {ref.tokens[i]} {ref.logprobs[i]:.5f}"]
        want = ref.top[i][:k]
        if len(e.top) != k or any(abs(a[1] - b[1]) > tol.lp for a, b in zip(e.top, want)):
            return [f"top log-probs {i}: {e.top} vs AR's {want}"]
        for j, ((tok, _), (want_tok, lp)) in enumerate(zip(e.top, want)):
            # ids may swap only where AR's own values tie
            ties = [x for m, (_, x) in enumerate(ref.top[i]) if m != j and abs(x - lp) <= tol.tie]
            if tok != want_tok and not ties:
                return [f"top log-probs {i}: {e.top} vs AR's {want}"]
    return []


def _sampled_logprobs(req) -> list[str]:
    if not req.params.logprobs:
        return []
    k = req.params.top_logprobs
    for i, e in enumerate(req.logprobs):
        vals = [v for _, v in e.top]
        if (
            e.token_id != req.output_ids[i]
            or not e.logprob <= 1e-6
            or len(e.top) != k
            or vals != sorted(vals, reverse=True)
            or (k and e.logprob > vals[0] + 1e-6)
        ):
            return [f"log-prob entry {i} inconsistent: {e} for token {req.output_ids[i]}"]
    return []


def check_pathological(grammar: tuple[str, str], got, stats: Counter) -> list[str]:
    """A call with a pathological grammar (tests/fuzz_http.py): refused or failed as too complex
    (a 400, or a stream's error event), the server busy (503), or answered with text its grammar
    accepts."""
    stats["http_pathological"] += 1
    if isinstance(got, str):
        if "grammar_too_complex" in got or "server_busy" in got:
            stats["http_pathological_refused"] += 1
            return []
        return [f"pathological grammar: {got}"]
    kind, source = grammar
    bad = []
    for c in got:
        if c.reason not in ("stop", "length", "grammar"):
            bad.append(f"pathological grammar: finish_reason {c.reason!r}")
        elif c.reason == "stop" and kind == "regex" and not re.fullmatch(source, c.text, re.S):
            bad.append(f"pathological grammar: {c.text!r} does not match {source!r}")
        elif c.reason == "stop" and kind == "json_schema":
            try:
                json.loads(c.text)
            except ValueError:
                bad.append(f"pathological grammar: {c.text!r} is not JSON")
    stats["http_pathological_served"] += not bad
    return bad


def check_call(call, got, ref, text_of: TextOf, ctx: int, eos, stats: Counter) -> list[str]:
    """Problems of one HTTP call's answer (tests/fuzz_http.py: `got` its choices, an error string,
    or None when the client gave up): greedy choices against AR cut by the stop rule (text, finish
    and, where the route returns them, ids, matched stop, token count, usage, log-probs); sampled
    ones under the rule on their own ids, with no stop string in their text."""
    if got is None:
        stats["http_disconnects"] += 1
        return []
    if isinstance(got, str):
        return [got]
    if len(got) != call.n:
        return [f"{len(got)} choices for n={call.n}"]
    sp, bad = call.params, []
    for i, c in enumerate(got):
        stats[f"http_{call.route}_{'stream' if call.stream else 'body'}"] += 1
        if c.reason not in ("stop", "length"):
            bad.append(f"choice {i}: finish_reason {c.reason!r}")
            continue
        stats["http_greedy_checked" if sp.greedy else "http_sampled_checked"] += 1
        if sp.greedy:
            exp = apply_stop_rule(text_of, call.prompt, ref.tokens, sp, ctx, eos)
            if c.ids is not None:
                k = first_difference(c.ids, exp.tokens)
                if k is not None and ref.gap(k) < FP32.tie:
                    stats["near_tie"] += 1
                    continue
            elif (c.text, c.reason) != (exp.text, exp.reason) and any(
                ref.gap(k) < FP32.tie for k in range(len(exp.tokens))
            ):
                stats["near_tie"] += 1
                continue
            want = (exp.text, exp.reason)
            if c.ids is not None:
                matched = exp.matched if exp.matched is not None else exp.tokens[-1]
                want += (exp.tokens, matched if exp.reason == "stop" else None, len(exp.tokens))
                have = (c.text, c.reason, c.ids, c.matched, c.tokens)
            else:
                have = (c.text, c.reason)
            if have != want:
                bad.append(f"choice {i}: {have} != AR cut by its stop rule {want}")
            elif c.usage is not None and c.usage != call.n * len(exp.tokens):
                bad.append(f"usage: {c.usage} completion tokens for {call.n} x {len(exp.tokens)}")
            elif c.logprobs is not None:
                if len(c.logprobs) != len(exp.tokens) or any(
                    abs(a - b) > 2e-3 for a, b in zip(c.logprobs, ref.logprobs)
                ):
                    bad.append(
                        f"choice {i}: log-probs {c.logprobs} vs AR's {ref.logprobs[: len(exp.tokens)]}"
                    )
        else:
            if not sp.include_stop_str_in_output and any(s in c.text for s in sp.stop):
                bad.append(f"choice {i}: a stop string is in the text {c.text!r}")
            if c.ids is not None:
                e = apply_stop_rule(text_of, call.prompt, c.ids, sp, ctx, eos)
                if (e.tokens, e.text, e.reason) != (c.ids, c.text, c.reason):
                    bad.append(
                        f"choice {i}: its own tokens {c.ids} finish as {e.reason} {e.text!r}, got {c.reason} {c.text!r}"
                    )
            if c.logprobs is not None and any(not x <= 1e-6 for x in c.logprobs):
                bad.append(f"choice {i}: log-probs {c.logprobs}")
    return bad


@torch.inference_mode()
def cached_state_problems(engine, ref_runner, tol: Tolerances = FP32) -> list[str]:
    """Every cached page of an idle engine holds the K / V a fresh prefill of its path's tokens
    computes, and every hybrid checkpoint the recurrent state after exactly its node's tokens
    (`ref_runner`: a plain runner of the same target, no prefix cache)."""
    from ddtree import SamplingParams
    from ddtree.engine.scheduling.request import Req

    runner = engine.runner
    bm, p = runner.bm, runner.bm.page_size
    if bm.cache is None:
        return []
    bad = []
    for leaf in [n for n in bm.cache.nodes() if not n.children]:
        path = leaf.path()
        tokens = [t for n in path for t in n.key]
        req = Req(prompt_ids=tokens + [tokens[-1]], params=SamplingParams(max_tokens=1))
        # chunks that end at each checkpointed node, so its state can be read there
        edges = [n.depth * p for n in path if n.checkpoint is not None] + [len(tokens)]
        try:
            for edge in sorted(set(edges)):
                ref_runner.bm.allocate(req, edge)
                ref_runner.prefill([req], [edge - req.kv_len])
                node = path[edge // p - 1]
                if node.checkpoint is not None and runner.checkpoints is not None:
                    bad += _state_diff(runner, ref_runner, node, req.slot, tol)
            bad += _kv_diff(runner, ref_runner, path, req, p, tol)
        finally:
            ref_runner.release(req)
        if len(bad) > 4:
            break
    return bad


def _kv_diff(runner, ref_runner, path, req, p: int, tol: Tolerances) -> list[str]:
    n = len(path) * p
    pos = torch.arange(n)
    pages = torch.tensor([node.page for node in path])
    ours = pages[pos // p] * p + pos % p
    rp = ref_runner.bm.page_size
    theirs = torch.tensor(ref_runner.bm.pages[req.slot])[pos // rp] * rp + pos % rp
    for name in ("k", "v"):
        a = getattr(runner.kv, name)[:, ours.to(runner.device)].float().cpu()
        b = getattr(ref_runner.kv, name)[:, theirs.to(ref_runner.device)].float().cpu()
        err = (a - b).abs().amax(dim=(0, 2, 3))  # per position
        bound = torch.clamp(tol.kv_rel * b.abs().amax(dim=(0, 2, 3)), min=tol.kv)
        if (err > bound).any():
            i = int((err - bound).argmax())
            return [
                f"cached page {path[i // p].page} (depth {i // p + 1}) position {i}: {name} "
                f"differs from a fresh prefill of its tokens by {float(err[i]):.3g}"
            ]
    return []


def _state_diff(runner, ref_runner, node, slot: int, tol: Tolerances) -> list[str]:
    ck, pool = runner.checkpoints, ref_runner.state_pool
    for name in ("conv", "ssm"):
        a = getattr(ck, name)[:, node.checkpoint].float()
        b = getattr(pool, name)[:, slot].float()
        if not torch.allclose(a, b, rtol=tol.state, atol=tol.state):
            err = float((a - b).abs().max())
            return [
                f"checkpoint row {node.checkpoint} of node depth {node.depth}: {name} differs "
                f"from a fresh prefill of its tokens by {err:.3g}"
            ]
    return []
