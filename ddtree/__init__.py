"""ddtree: DDTree speculative decoding on DFlash drafters, served like SGLang."""

from ddtree.engine.outputs import RequestOutput
from ddtree.engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):
    if name == "LLM":  # lazy: importing ddtree stays cheap for `ddtree check-config`
        from ddtree.llm import LLM

        return LLM
    raise AttributeError(name)
