"""Offline API: `LLM(model_path, **ServerArgs fields).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses

from ddtree.engine.engine import LLMEngine
from ddtree.engine.outputs.emitter import RequestOutput
from ddtree.engine.scheduling.request import SamplingParams


class LLM:
    def __init__(self, model_path: str | None = None, **kwargs):
        from ddtree.config import ServerArgs, resolve_server_args

        fields = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"unknown LLM arguments {unknown}; they must be ServerArgs fields")
        self.args = resolve_server_args(ServerArgs(model_path=model_path, **kwargs))
        self.engine = LLMEngine(self.args)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        reqs = self.engine.generate(list(prompts), params, use_tqdm=use_tqdm)
        return [RequestOutput.of(r) for r in reqs]
