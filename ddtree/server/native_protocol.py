"""SGLang's native `/generate` request (`io_struct.GenerateReqInput`,
`sampling_params.SamplingParams` field names) and its translation into engine SamplingParams.

Accepted: `text` or `input_ids` (one prompt or a batch), `sampling_params` (one dict or one per
prompt: max_new_tokens [128], temperature, top_p, top_k, stop, stop_token_ids, ignore_eos, n,
sampling_seed, no_stop_trim, skip_special_tokens, spaces_between_special_tokens, plus our
`ddtree_budget`; constrained decoding: `json_schema`, `regex`, `ebnf` and vLLM's `guided_*` /
`structured_outputs`, server/structured.py), `stream`, `return_logprob`, `top_logprobs_num`,
`return_text_in_logprobs`, `rid`, `separate_reasoning` (with --reasoning-parser:
the think block as `reasoning_text`, `text` without it).
With `return_logprob`, input log-probs from `logprob_start_len` on (SGLang's: -1 = the last prompt
token only, whose entry has no log-prob; `max_new_tokens` 0 scores a prompt without generating).
SGLang options this engine cannot honour (penalties, min_p, min_new_tokens, logit_bias, stop_regex;
request_fields.GENERATE_REFUSED at the top level) are refused
with a 400 naming the field when set to anything but their neutral value; a `sampling_params` key
SGLang does not know either is refused, as SGLang does. Bounds are the OpenAI routes'
(server/limits.py), plus MAX_BATCH_REQUESTS prompts x n per call.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ddtree.engine.round.logprobs import MAX_TOP_LOGPROBS
from ddtree.engine.scheduling.request import SamplingParams
from ddtree.grammar import GrammarSpec
from ddtree.server import request_fields
from ddtree.server.limits import (
    MAX_BATCH_REQUESTS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    Finite,
    Name,
    StopString,
    Text,
)
from ddtree.server.protocol import MAX_N, MAX_SEED, APIError, GrammarFields, check_extra, invalid

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default

Batch = Field(max_length=MAX_BATCH_REQUESTS)


class NativeSamplingParams(GrammarFields):
    # undeclared keys are kept (model_extra) and refused by check_native
    model_config = ConfigDict(extra="allow")

    max_new_tokens: StrictInt | None = DEFAULT_MAX_NEW_TOKENS
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: StrictInt | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    sampling_seed: StrictInt | None = None
    ddtree_budget: StrictInt | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    stream_interval: StrictInt | None = None  # SGLang's streaming cadence: every token here
    min_p: Finite | None = None
    frequency_penalty: Finite | None = None
    presence_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    min_new_tokens: int | None = None
    logit_bias: dict | None = None
    stop_regex: str | list[str] | None = None
    custom_params: dict | None = None
    UNSUPPORTED: ClassVar[tuple] = (
        ("min_p", (None, 0)),
        ("frequency_penalty", (None, 0)),
        ("presence_penalty", (None, 0)),
        ("repetition_penalty", (None, 1)),
        ("min_new_tokens", (None, 0)),
        ("logit_bias", (None, {})),
        ("stop_regex", (None, [], "")),
        ("custom_params", (None, {})),
    )


class GenerateRequest(BaseModel):
    # undeclared fields are kept (model_extra) for request_fields
    model_config = ConfigDict(extra="allow")

    text: Text | Annotated[list[Text], Batch] | None = None
    input_ids: list[StrictInt] | Annotated[list[list[StrictInt]], Batch] | None = None
    sampling_params: NativeSamplingParams | Annotated[list[NativeSamplingParams], Batch] | None = (
        None
    )
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: StrictInt = 0
    return_text_in_logprobs: StrictBool = False
    logprob_start_len: StrictInt = -1
    rid: Name | Annotated[list[Name], Batch] | None = None
    separate_reasoning: StrictBool = False

    def prompts(self) -> tuple[list, bool]:
        """(prompts: strings or token-id lists, whether the request was a batch)."""
        if (self.text is None) == (self.input_ids is None):
            raise invalid("text", "give exactly one of text and input_ids")
        if self.text is not None:
            batch = isinstance(self.text, list)
            prompts, param = (self.text if batch else [self.text]), "text"
        else:
            batch = bool(self.input_ids) and isinstance(self.input_ids[0], list)
            prompts, param = (self.input_ids if batch else [self.input_ids]), "input_ids"
        if not prompts or any(len(p) == 0 for p in prompts):
            raise invalid(param, "is empty")
        return prompts, batch

    def params_for(self, n_prompts: int) -> list[NativeSamplingParams]:
        sp = self.sampling_params
        if isinstance(sp, list):
            if len(sp) != n_prompts:
                raise invalid("sampling_params", f"has {len(sp)} entries for {n_prompts} prompts")
            return sp
        return [sp or NativeSamplingParams()] * n_prompts


def check_batch(req: GenerateRequest, prompts: list, sps: list[NativeSamplingParams]) -> None:
    """One call admits at most MAX_BATCH_REQUESTS requests (prompts x n), checked before any is
    tokenized; the top-level fields SGLang has and this server cannot honour are refused."""
    check_extra(req.model_extra, request_fields.GENERATE_REFUSED, "/generate")
    total = sum(max(sp.n, 1) for sp in sps)
    if total > MAX_BATCH_REQUESTS:
        param = "text" if req.text is not None else "input_ids"
        raise invalid(
            param,
            f"{len(prompts)} prompts x n make {total} requests; at most {MAX_BATCH_REQUESTS} "
            "per call (split the batch)",
        )


def check_native(req: GenerateRequest, sp: NativeSamplingParams) -> None:
    if req.logprob_start_len < -1:
        raise invalid(
            "logprob_start_len",
            f"must be -1 (output log-probs only) or a prompt position (got {req.logprob_start_len})",
        )
    if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise invalid(
            "top_logprobs_num", f"must be in 0..{MAX_TOP_LOGPROBS} (got {req.top_logprobs_num})"
        )
    for name, neutral in sp.UNSUPPORTED:
        if getattr(sp, name) not in neutral:
            raise invalid(
                f"sampling_params.{name}",
                "is not supported by this server; leave it unset",
                code="unsupported_parameter",
            )
    for name in sp.model_extra or {}:
        raise invalid(
            f"sampling_params.{name}",
            "is not a sampling parameter of this server (nor of SGLang's /generate)",
            code="unsupported_parameter",
        )
    if not 1 <= sp.n <= MAX_N:
        raise invalid("sampling_params.n", f"must be in 1..{MAX_N} (got {sp.n})")
    seed = sp.sampling_seed
    if seed is not None and not 0 <= seed <= MAX_SEED - sp.n:
        raise invalid("sampling_params.sampling_seed", f"must be in [0, 2**63 - n] (got {seed})")


def native_sampling_params(
    req: GenerateRequest,
    sp: NativeSamplingParams,
    prompt_len: int,
    max_context: int,
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    """Validated SamplingParams; each bad value raises a 400 naming its field."""
    room = max_context - prompt_len
    max_new = room if sp.max_new_tokens is None else sp.max_new_tokens
    if max_new < 0:  # 0: the prompt alone (its input log-probs), as SGLang allows
        raise invalid("sampling_params.max_new_tokens", f"must be at least 0 (got {max_new})")
    if max_new > room:
        raise APIError(
            400,
            f"sampling_params.max_new_tokens: {max_new} is too large: the prompt has {prompt_len}"
            f" tokens and the context length is {max_context}, so at most {room} can be generated",
            param="sampling_params.max_new_tokens",
            code="context_length_exceeded",
        )
    temperature = 1.0 if sp.temperature is None else sp.temperature
    if temperature < 0:
        raise invalid("sampling_params.temperature", f"must be >= 0 (got {temperature})")
    top_p = 1.0 if sp.top_p is None else sp.top_p
    if not 0 < top_p <= 1:
        raise invalid("sampling_params.top_p", f"must be in (0, 1] (got {top_p})")
    top_k = -1 if sp.top_k is None else sp.top_k
    if top_k < -1:
        raise invalid(
            "sampling_params.top_k", f"must be -1 (disabled) or a positive count (got {top_k})"
        )
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    if any(s == "" for s in stop):
        raise invalid("sampling_params.stop", "stop strings must be non-empty")
    if any(t < 0 for t in sp.stop_token_ids or ()):
        raise invalid("sampling_params.stop_token_ids", "token ids must be non-negative")
    if sp.ddtree_budget is not None and sp.ddtree_budget < 1:
        raise invalid("sampling_params.ddtree_budget", f"must be >= 1 (got {sp.ddtree_budget})")
    # SGLang: input log-probs from logprob_start_len (-1: the last prompt token, i.e. none)
    start = prompt_len - 1 if req.logprob_start_len == -1 else req.logprob_start_len
    if req.return_logprob and start >= prompt_len:
        raise invalid(
            "logprob_start_len",
            f"{start} is not below the prompt's {prompt_len} tokens",
        )
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_new,
            stop=stop,
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
            seed=sp.sampling_seed,
            ddtree_budget=sp.ddtree_budget,
            logprobs=req.return_logprob,
            top_logprobs=req.top_logprobs_num if req.return_logprob else 0,
            include_stop_str_in_output=sp.no_stop_trim,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            grammar=grammar,
            prompt_logprobs=req.top_logprobs_num if req.return_logprob else None,
            prompt_logprobs_start=start if req.return_logprob else 0,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from e
