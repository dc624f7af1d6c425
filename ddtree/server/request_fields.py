"""Request fields this server does not declare: refused when they would change the output, ignored
(with a warning) when nobody knows them.

The rule: no field of vLLM's or SGLang's request models that changes what a request generates is
ever silently ignored. Each is honoured (declared on the schemas in server/protocol.py and
server/native_protocol.py) or listed here with the values that leave the output unchanged; any
other value is a 400 naming the field (code `unsupported_parameter`). Fields that only steer
routing, logging or ids (`request_id`, `priority` 0, `rid`, ...) are accepted and ignored.

A field neither server knows is ignored with a warning, as vLLM does (it logs "fields were
present in the request but ignored"); the exception is `/generate`'s `sampling_params`, whose
unknown keys SGLang refuses (its SamplingParams takes no others) and so do we. Unknown fields are
bounded: more than limits.MAX_UNKNOWN_FIELDS in one object, or a name over limits.MAX_NAME_CHARS,
is a 400 (`UnknownFieldsOverBound`). The warning names each (route, name) once, at most
WARN_SAMPLE names a line, and remembers at most WARNED_NAMES of them for the process: a client
sending new names forever grows neither the memory nor the log.

Grammar, structured-output, tool and reasoning fields (`guided_*`, `structured_outputs`,
`response_format`, `json_schema`, `regex`, `ebnf`, `structural_tag`, `tools`, `tool_choice`,
`functions`, `chat_template_kwargs`, `reasoning_effort`, `separate_reasoning`, ...) are not in these
tables: they belong with the grammar work (protocol.py's UNSUPPORTED lists hold the ones refused
today).
"""

from __future__ import annotations

import logging
import threading

from ddtree.server import limits

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


class UnknownFieldsOverBound(ValueError):
    """More unknown fields than limits.MAX_UNKNOWN_FIELDS, or one with a name too long; the
    message names the bound (the caller answers 400)."""


def refused_field(extra: dict | None, refused: dict[str, tuple], route: str) -> str | None:
    """The first undeclared field whose value would change the output (the caller answers 400
    naming it), or None; fields nobody knows are warned about (UnknownFieldLog) and ignored.
    Raises UnknownFieldsOverBound when the unknown ones are over their bounds."""
    unknown = []
    for name, value in (extra or {}).items():
        neutral = refused.get(name)
        if neutral is not None:
            if value not in neutral:
                return name
        elif name not in HARMLESS:
            unknown.append(name)
    if len(unknown) > limits.MAX_UNKNOWN_FIELDS:
        raise UnknownFieldsOverBound(
            f"the request has {len(unknown)} fields this server does not know; at most "
            f"{limits.MAX_UNKNOWN_FIELDS} (MAX_UNKNOWN_FIELDS) are accepted"
        )
    long = next((n for n in unknown if len(n) > limits.MAX_NAME_CHARS), None)
    if long is not None:
        raise UnknownFieldsOverBound(
            f"the request has a field named with {len(long)} characters; names of at most "
            f"{limits.MAX_NAME_CHARS} (MAX_NAME_CHARS) are accepted"
        )
    if unknown:
        UNKNOWN_LOG.warn(route, unknown)
    return None


WARN_SAMPLE = 8  # names one warning line lists
WARNED_NAMES = 1024  # (route, name) pairs remembered; then unknown fields go unlogged


class UnknownFieldLog:
    """Warns once per (route, name), with bounded state: after WARNED_NAMES pairs one last line
    says that further names are not logged."""

    def __init__(self, capacity: int = WARNED_NAMES):
        self.capacity = capacity
        self.seen: set[tuple[str, str]] = set()
        self.full = False
        self.lock = threading.Lock()  # handlers of several threads (tokenizer pool, dp replicas)

    def warn(self, route: str, names: list[str]) -> None:
        with self.lock:
            if self.full:
                return
            new = sorted(n for n in set(names) if (route, n) not in self.seen)
            if not new:
                return
            room = self.capacity - len(self.seen)
            self.seen.update((route, n) for n in new[:room])
            self.full = len(new) >= room
        more = f" (and {len(new) - WARN_SAMPLE} more)" if len(new) > WARN_SAMPLE else ""
        logger.warning(
            "%s: request fields %s%s are not known to this server and were ignored",
            route,
            new[:WARN_SAMPLE],
            more,
        )
        if self.full:
            logger.warning(
                "%d unknown request field names were logged; further ones are not", self.capacity
            )

    def clear(self) -> None:
        with self.lock:
            self.seen.clear()
            self.full = False


UNKNOWN_LOG = UnknownFieldLog()  # the process's one log of unknown names (bounded)
