"""The offline API: `LLM(model_dir, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from typing import Sequence

from .config import EngineConfig
from .engine import EngineCore
from .output_processor import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str, show_progress: bool = False, **engine_args):
        self.engine = EngineCore(EngineConfig(model=model, **engine_args), show_progress=show_progress)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        session_id: str | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion (continuous batching); outputs in prompt order. `session_id`: the
        conversation these prompts continue (its cached blocks are evicted last while it is live)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("pass one SamplingParams, or one per prompt")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        token_lists = [self._token_ids(p) for p in prompts]  # validate everything before adding anything
        for token_ids, params in zip(token_lists, sampling_params):
            self.engine.validate(token_ids, params)
        for rid, token_ids, params in zip(ids, token_lists, sampling_params):
            self.engine.add_request(rid, token_ids, params, session_id=session_id)
        outputs = {rid: RequestOutput(rid, token_ids) for rid, token_ids in zip(ids, token_lists)}
        left = len(ids)
        while left:
            for delta in self.engine.step():
                out = outputs[delta.request_id].add(delta)
                left -= out.finished
        return list(outputs.values())

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs a chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return self.generate([ids], sampling_params)[0]
