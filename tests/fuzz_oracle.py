"""The differential fuzzer's reference, independent of the engine's stop logic.

`References` runs plain AR once per prompt (no speculation, no prefix cache, `ignore_eos`) for a long
continuation with each position's top log-probs. `apply_stop_rule` is a small oracle of its own that
cuts a token sequence where a request must finish: a stop token (EOS unless `ignore_eos`, a stop
id: counted, its text left out), a stop string found in the text the tokenizer's full decode gives
(prompt + tokens, minus the prompt's own text), then `max_tokens` or the context length - the
engine's documented order (vLLM's), one token at a time; `include_stop_str_in_output` keeps the stop
string and the stop token's text. It does not share code with `TokenEmitter` / `IncrementalDetokenizer` / `StopMatcher`.

At T=0 a request's output must be `apply_stop_rule(reference continuation)`. At T>0 (and for an
aborted request) it must be its own tokens under the same rule: `apply_stop_rule(own tokens)`
cuts nowhere before the end, and at the end gives the request's text and finish reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# top log-probs the reference keeps per position (>= any top_logprobs the fuzzer asks for)
REF_TOP = 5
# tokens of reference continuation per prompt (>= the largest max_tokens + a stop's look-ahead)
REF_TOKENS = 64


@dataclass
class Continuation:
    """AR's greedy continuation of one prompt: tokens, each one's log-prob and the top REF_TOP."""

    tokens: list[int]
    logprobs: list[float]
    top: list[tuple[tuple[int, float], ...]]

    def gap(self, k: int) -> float:
        """How far position k's chosen token is ahead of the runner-up (log-prob): a divergence
        where it is tiny is a numerical near-tie, not a bug."""
        top = self.top[k]
        return top[0][1] - top[1][1] if len(top) > 1 else float("inf")


@dataclass
class Expected:
    tokens: list[int]
    text: str
    reason: str | None  # None: no finish within the given tokens
    matched: str | None = None  # the stop string that finished it
    offsets: list[int] = field(default_factory=list)  # len(text) after each token (uncut)


class TextOf:
    """Text of tokens after a prompt by the tokenizer's full decode (special tokens skipped unless
    the request says otherwise)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def decode(self, ids, skip: bool = True, spaces: bool = True) -> str:
        kw = {} if spaces else {"spaces_between_special_tokens": False}
        return self.tok.decode(
            list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False, **kw
        )

    def after(self, prompt, tokens, params=None) -> str:
        skip = params is None or params.skip_special_tokens
        spaces = params is None or params.spaces_between_special_tokens
        base = self.decode(prompt, skip, spaces)
        full = self.decode(list(prompt) + list(tokens), skip, spaces)
        assert full.startswith(base), f"decode is not prefix-stable: {base!r} vs {full!r}"
        return full[len(base) :]


def apply_stop_rule(text_of: TextOf, prompt, tokens, params, max_context: int, eos_ids) -> Expected:
    """Where and why a request decoding `tokens` after `prompt` finishes (see the module doc). A
    stop token (EOS unless ignore_eos, a stop id) finishes first and adds no text; with
    `include_stop_str_in_output` it is text like any token, after the stop strings, and a stop
    string stays in the text."""
    eos = set(eos_ids)
    stop_ids = set(params.stop_token_ids)
    keep_stop = params.include_stop_str_in_output
    offsets: list[int] = []
    text = ""
    for k in range(1, len(tokens) + 1):
        tok = tokens[k - 1]
        stop_token = (tok in eos and not params.ignore_eos) or tok in stop_ids
        if stop_token and not keep_stop:  # counted, never detokenised
            return Expected(list(tokens[:k]), text, "stop", None, offsets)
        text = text_of.after(prompt, tokens[:k], params)
        offsets.append(len(text))
        if params.stop:
            hits = [(text.find(s), -len(s), s) for s in params.stop if s in text]
            if hits:
                cut, _, s = min(hits)  # the earliest start; at one start the longest stop
                keep = cut + len(s) if keep_stop else cut
                return Expected(list(tokens[:k]), text[:keep], "stop", s, offsets)
        if stop_token:
            return Expected(list(tokens[:k]), text, "stop", None, offsets)
        if k >= params.max_tokens or len(prompt) + k >= max_context:
            return Expected(list(tokens[:k]), text, "length", None, offsets)
    return Expected(list(tokens), text, None, None, offsets)


class References:
    """AR continuations per (target, prompt), computed in batches by a plain engine per target
    (NONE, no prefix cache, fp32) and kept for the process. A target "NAME:fp8" is NAME's pair
    quantized to block FP8 at load: an engine and continuations of its own."""

    def __init__(
        self,
        pairs: dict[str, tuple[str, str]],
        device: str = "cpu",
        dflash2: dict[str, str] | None = None,
    ):
        """device: where the fuzzed engines and the references run ("cuda": CUDA graphs on, as a
        server runs; graphs captured up to batch 8 to keep each case's start short). dflash2: a
        DFlash2 drafter directory per target, for the cases that draft with one."""
        self.pairs, self.device = pairs, device
        self.dflash2 = dflash2 or {}
        self.engine_kwargs = {"device": device}
        if device == "cuda":
            self.engine_kwargs["cuda_graph_max_bs"] = 8
        self.llms: dict[str, object] = {}
        self.cache: dict[tuple[str, tuple[int, ...]], Continuation] = {}

    def llm(self, target: str):
        if target not in self.llms:
            from engine_utils import make_llm

            name, _, quant = target.partition(":")
            self.llms[target] = make_llm(
                self.pairs[name],
                "NONE",
                disable_radix_cache=True,
                max_running_requests=64,
                page_size=16,
                **({"quantization": quant} if quant else {}),
                **self.engine_kwargs,
            )
        return self.llms[target]

    def pair(self, target: str, drafter: str = "dflash") -> tuple[str, str]:
        """(target_dir, drafter_dir) of a case: the target's own pair, or its DFlash2 drafter."""
        name = target.partition(":")[0]
        target_dir, drafter_dir = self.pairs[name]
        return (
            (target_dir, self.dflash2[name]) if drafter == "dflash2" else (target_dir, drafter_dir)
        )

    def tokenizer(self, target: str):
        return self.llm(target).tokenizer

    def max_context(self, target: str) -> int:
        return self.llm(target).engine.max_context

    def get(self, target: str, prompts) -> dict[tuple[int, ...], Continuation]:
        from ddtree import SamplingParams

        prompts = [tuple(p) for p in prompts]
        missing = sorted({p for p in prompts if (target, p) not in self.cache})
        if missing:
            llm, ctx = self.llm(target), self.max_context(target)
            params = [
                SamplingParams(
                    temperature=0,
                    max_tokens=min(REF_TOKENS, ctx - len(p) - 1),
                    ignore_eos=True,
                    top_logprobs=REF_TOP,
                )
                for p in missing
            ]
            outs = llm.generate([list(p) for p in missing], params)
            for p, o in zip(missing, outs):
                self.cache[(target, p)] = Continuation(
                    list(o.token_ids),
                    [e.logprob for e in o.logprobs],
                    [e.top for e in o.logprobs],
                )
        return {p: self.cache[(target, p)] for p in prompts}

    def runs(self, target: str, requests, top: int = 2) -> list:
        """AR's own outputs (`RequestOutput`) of (prompt, params) requests, with the `top` log-probs
        of each token for the near-tie test: the reference of a grammar request, or of a seeded
        sampled one (the same seed: the same tokens)."""
        import dataclasses

        if not requests:
            return []
        params = [
            dataclasses.replace(p, logprobs=True, top_logprobs=max(top, p.top_logprobs))
            for _, p in requests
        ]
        return self.llm(target).generate([list(q) for q, _ in requests], params)
