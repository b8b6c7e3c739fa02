"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, no services needed."""
from __future__ import annotations

from dataclasses import dataclass

from specd.config import EngineConfig, SpeculativeConfig
from specd.engine.llm_engine import LLMEngine
from specd.engine.loader import release_freed_memory, resolve_model_dir
from specd.proposers.factory import in_process_proposer
from specd.sampling import SamplingParams
from specd.models.tokenizer import Tokenizer

Prompt = str | list[int] | dict


@dataclass
class RequestOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[float] | None = None
    # Per token when SamplingParams.logprobs = n > 0: the n most likely (token id, logprob), best first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    spec: dict | None = None  # speculation counters when speculation was configured
    choice: int = 0  # with SamplingParams.n > 1: which of the prompt's n choices (they come in order)

    def to_dict(self) -> dict:
        d = {"index": self.index, "prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
             "text": self.text, "finish_reason": self.finish_reason}
        if self.spec is not None:
            d["spec"] = self.spec
        return d


class LLM:
    def __init__(self, model: str, speculative_config: "str | dict | SpeculativeConfig | None" = None,
                 **engine_kwargs):
        spec = SpeculativeConfig.parse(speculative_config)
        config = EngineConfig(model=model, **engine_kwargs)
        # The tokenizer before the engine, and what parsing it freed handed back, so the peak
        # resident size does not hold that garbage on top of the weights and the KV cache.
        self.tokenizer = Tokenizer.from_dir(resolve_model_dir(config.model, weights=False))
        release_freed_memory()
        self.engine = LLMEngine(config, spec, proposer_factory=in_process_proposer)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        token_prompts = [self._tokenize(p) for p in prompts]  # validate all before starting any
        ids: list[tuple[int, int, int]] = []  # (prompt index, choice, sequence id)
        try:
            for i, (toks, sp) in enumerate(zip(token_prompts, params)):
                seq_id = self.engine.add_request(toks, sp)
                ids += [(i, c, s) for c, s in enumerate([seq_id, *(f.seq_id for f in self.engine.sequences[seq_id].forks)])]
            done = {}
            while self.engine.has_unfinished():
                for seq in self.engine.step():
                    done[seq.seq_id] = seq
        finally:
            for _, _, seq_id in ids:  # an exception mid-run must not leak KV blocks
                self.engine.abort(seq_id)
        return [self._output(i, done[seq_id], choice) for i, choice, seq_id in ids]

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.engine.model_dir} has no tokenizer.json; pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError(f"a prompt must be text, a list of token ids or a dict, got {type(prompt).__name__}")

    def _output(self, index: int, seq, choice: int = 0) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer is not None else None
        checker = seq.stop_checker
        if checker is not None and checker.match is not None:
            text = checker.text[:checker.match]  # as OpenAI: the stop string is not returned
        return RequestOutput(
            index=index,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=text,
            finish_reason=seq.finish_reason,
            logprobs=seq.output_logprobs if seq.params.want_logprobs else None,
            top_logprobs=[list(zip(ids, lps)) for ids, lps in seq.output_top_logprobs]
            if seq.params.num_top_logprobs else None,
            spec=self._spec_dict(seq),
            choice=choice,
        )

    def _spec_dict(self, seq) -> dict | None:
        speculator = self.engine.speculator
        if speculator is None:
            return None
        d = seq.spec_stats.to_dict()
        if speculator.lossy:
            d["lossy"] = speculator.config.rejection_sample_method
        return d


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty list (or a single prompt)")
    return prompts
