"""Request fields this server does not declare: refused when they would change the output, ignored
(with a warning) when nobody knows them.

The rule: no field of vLLM's or SGLang's request models that changes what a request generates is
ever silently ignored. Each is honoured (declared on the schemas in server/protocol.py and
server/native_protocol.py) or listed here with the values that leave the output unchanged; any
other value is a 400 naming the field (code `unsupported_parameter`). Fields that only steer
routing, logging or ids (`request_id`, `priority` 0, `rid`, ...) are accepted and ignored.

A field neither server knows is ignored with one warning per name, as vLLM does (it logs "fields
were present in the request but ignored"); the exception is `/generate`'s `sampling_params`, whose
unknown keys SGLang refuses (its SamplingParams takes no others) and so do we.

Grammar, structured-output, tool and reasoning fields (`guided_*`, `structured_outputs`,
`response_format`, `json_schema`, `regex`, `ebnf`, `structural_tag`, `tools`, `tool_choice`,
`functions`, `chat_template_kwargs`, `reasoning_effort`, `separate_reasoning`, ...) are not in these
tables: they belong with the grammar work (protocol.py's UNSUPPORTED lists hold the ones refused
today).
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("ddtree")

OFF = (None, False)  # a flag left off
UNSET = (None,)
EMPTY = (None, [], {}, "")

# vLLM's and SGLang's completion / chat request fields that change the output, with their neutral
# values (values of a declared field are checked by protocol.py instead)
SAMPLING_REFUSED: dict[str, tuple] = {
    # search and scoring
    "use_beam_search": OFF,
    "length_penalty": (None, 1, 1.0),
    "best_of": (None, 1),
    # token filters and logit processors
    "allowed_token_ids": UNSET,
    "bad_words": EMPTY,
    "logits_processors": EMPTY,
    "custom_logit_processor": EMPTY,
    "custom_params": EMPTY,
    "stop_regex": EMPTY,
    "watermarking": OFF,
    "repetition_detection": UNSET,
    # prompt handling
    "truncate_prompt_tokens": UNSET,
    "prompt_embeds": UNSET,
    "cache_salt": EMPTY,  # salts the prefix cache: isolation this server does not give
    # what is returned
    "logprob_token_ids": UNSET,
    "return_tokens_as_token_ids": OFF,
    "return_token_ids": OFF,
    "return_prompt_token_ids": OFF,
    "return_prompt_text": OFF,
    "return_meta_info": OFF,
    "return_hidden_states": OFF,
    "return_routed_experts": OFF,
    "return_cached_tokens_details": OFF,
    # adapters, sessions, disaggregation, extensions
    "lora_path": EMPTY,
    "lora_request": EMPTY,
    "session_params": EMPTY,
    "kv_transfer_params": EMPTY,
    "ec_transfer_params": EMPTY,
    "vllm_xargs": EMPTY,
    "bootstrap_host": EMPTY,
    "bootstrap_port": EMPTY,
    "bootstrap_room": EMPTY,
    # scheduling: only the default order exists
    "priority": (None, 0),
}

CHAT_REFUSED: dict[str, tuple] = SAMPLING_REFUSED | {
    "echo": OFF,
    "chat_template": EMPTY,
    "documents": EMPTY,
    "mm_processor_kwargs": EMPTY,
    "media_io_kwargs": EMPTY,
    "images_config": EMPTY,
    "max_dynamic_patch": UNSET,
    "min_dynamic_patch": UNSET,
    "use_audio_in_video": OFF,
    "input_ids": EMPTY,  # SGLang: pre-rendered prompt ids that bypass the chat template
    "task": UNSET,
}

# SGLang's GenerateReqInput beyond what native_protocol.py declares
GENERATE_REFUSED: dict[str, tuple] = {
    "input_embeds": EMPTY,
    "image_data": EMPTY,
    "video_data": EMPTY,
    "audio_data": EMPTY,
    "token_ids_logprob": EMPTY,
    "return_hidden_states": OFF,
    "return_routed_experts": OFF,
    "return_indexer_topk": OFF,
    "return_entropy": OFF,
    "return_bytes": OFF,
    "lora_path": EMPTY,
    "lora_id": EMPTY,
    "session_params": EMPTY,
    "custom_logit_processor": EMPTY,
    "positional_embed_overrides": EMPTY,
    "bootstrap_host": EMPTY,
    "bootstrap_port": EMPTY,
    "bootstrap_room": EMPTY,
    "bootstrap_pair_key": EMPTY,
    "background": OFF,
    "priority": (None, 0),
}

# known, and without effect on what is generated: accepted without a warning
HARMLESS = frozenset(
    {
        # ids, labels, logging
        "request_id",
        "session_id",
        "rid",
        "extra_key",
        "routing_key",
        "conversation_id",
        "custom_labels",
        "no_logs",
        "log_metrics",
        "metadata",
        "store",
        "service_tier",
        "ngram_corpus_id",
        # routing between engines of a deployment this server is one of
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "decode_tp_size",
        # streaming cadence and return-data windows that are off
        "stream_interval",
        "routed_experts_prompt_start",
        "routed_experts_start_len",
        "return_token_offsets",
        "return_mm_kwargs",
        "truncation_side",  # acts only with truncate_prompt_tokens, which is refused
        "modalities",
        "parallel_tool_calls",
    }
)


def refused_field(extra: dict | None, refused: dict[str, tuple], route: str) -> str | None:
    """The first undeclared field whose value would change the output (the caller answers 400
    naming it), or None; a field nobody knows is warned about once per name and ignored."""
    unknown = []
    for name, value in (extra or {}).items():
        neutral = refused.get(name)
        if neutral is not None:
            if value not in neutral:
                return name
        elif name not in HARMLESS:
            unknown.append(name)
    if unknown:
        _warn_unknown(route, tuple(sorted(unknown)))
    return None


@functools.lru_cache(maxsize=256)  # one warning per route and set of names
def _warn_unknown(route: str, names: tuple[str, ...]) -> None:
    logger.warning(
        "%s: request fields %s are not known to this server and were ignored", route, list(names)
    )
