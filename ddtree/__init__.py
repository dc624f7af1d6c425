"""ddtree: DDTree speculative decoding on DFlash drafters, served like SGLang."""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "ServerArgs", "prepare_server_args"]

_LAZY = {  # lazy so `ddtree check-config` never imports torch
    "LLM": ("ddtree.llm", "LLM"),
    "SamplingParams": ("ddtree.engine.scheduling.request", "SamplingParams"),
    "RequestOutput": ("ddtree.engine.outputs.emitter", "RequestOutput"),
    "ServerArgs": ("ddtree.config", "ServerArgs"),
    "prepare_server_args": ("ddtree.config", "prepare_server_args"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(name)
