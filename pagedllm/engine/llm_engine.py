"""LLMEngine: the synchronous frontend used by `LLM` (and the CLI): text in, RequestOutputs out."""

from __future__ import annotations

import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


def load_tokenizer(config: EngineConfig) -> Any:
    mc = config.model_config
    if mc.skip_tokenizer_init:
        return None
    from pagedllm.loader.tokenizer import get_tokenizer

    return get_tokenizer(mc.source, mc.tokenizer, mc.trust_remote_code)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.engine_core = EngineCore(config)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this engine was started with skip_tokenizer_init; it has no tokenizer.")
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate everything first, then queue: a bad request leaves no trace."""
        arrival_time = arrival_time if arrival_time is not None else time.time()
        prep = self.processor.process_request(request_id, prompt, params, arrival_time)
        added: list[str] = []
        try:
            for request, state in zip(prep.requests, prep.states):
                self.engine_core.add_request(request)
                added.append(request.request_id)
                self.output_processor.add_request(state)
        except ValueError:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests(added)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, stops = self.output_processor.process_outputs(core_outputs)
        if stops:
            self.engine_core.stop_requests(stops)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.scheduler.get_num_unfinished_requests()
