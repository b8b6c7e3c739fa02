"""The engine loop: schedule → propose → forward → sample/accept → postprocess, one call each per step."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from specd.config import EngineConfig, SpeculativeConfig
from specd.models.detokenizer import StopChecker
from specd.engine import kv_memory
from specd.engine.block_manager import BlockManager
from specd.engine.penalties import apply_penalties
from specd.engine.loader import (default_device, large_buffers_off_the_heap, load_checkpoint,
                                 open_checkpoint)
from specd.engine.logprobs import StepLogprobs
from specd.engine.model_runner import ModelRunner
from specd.engine.sampler import Sampler, SamplingMetadata, make_generator
from specd.engine.scheduler import ScheduledSeq, Scheduler
from specd.engine.sequence import SeqStatus, Sequence
from specd.sampling import SamplingParams
from specd.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

@dataclass
class StepTimings:
    """Where step time goes (benchmarks read it): proposing vs the target forward + accept."""

    steps: int = 0
    propose_s: float = 0.0
    verify_s: float = 0.0
    forward_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens the forward computed (not prefix-cache hits, not forks)
    mask_s: float = 0.0  # structured output: cutting drafts and filling grammar masks
    masked_rows: int = 0

    def observe(self, propose_s: float, verify_s: float, tokens: int) -> None:
        self.steps += 1
        self.propose_s += propose_s
        self.verify_s += verify_s
        self.forward_tokens += tokens


DEFAULT_GPU_MEMORY_FRACTION = 0.85
DEFAULT_MAX_BATCHED_TOKENS = 2048


class LLMEngine:
    def __init__(self, config: EngineConfig, speculative_config: SpeculativeConfig | None = None,
                 proposer=None, proposer_factory=None):
        """proposer: where drafts come from (the verifier passes its drafter pool); else
        proposer_factory(speculative_config, engine) builds one in this process once the target is
        loaded (specd.proposers.factory.in_process_proposer: specd.LLM and the verifier pass it).
        The engine never imports a proposer (docs/architecture.md, the import rules)."""
        self.config = config
        self.device = default_device(config.device)
        if self.device.type == "cpu":
            large_buffers_off_the_heap()
        ckpt = open_checkpoint(config.model, config.dtype, self.device)
        self.model_dir, self.arch, self.dtype = ckpt.dir, ckpt.arch, ckpt.dtype
        self.max_model_len = self._max_model_len(config)
        self.model = load_checkpoint(ckpt, self.device, self.max_model_len, config.batch_invariant)
        num_blocks = self._num_kv_blocks(config)
        # Cached blocks' hashes are salted with the weights' fingerprint: equal hashes mean equal
        # tokens on this model (a cache never outlives its model; the salt says so in the key).
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          salt=self.model.fingerprint.encode())
        batched = config.max_num_batched_tokens or (
            DEFAULT_MAX_BATCHED_TOKENS if config.enable_chunked_prefill
            else max(DEFAULT_MAX_BATCHED_TOKENS, self.max_model_len))
        if not config.enable_chunked_prefill and batched < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({batched}) must be >= max_model_len "
                             f"({self.max_model_len}) when chunked prefill is off")
        self.eos_token_ids = set(self.arch.eos_token_ids)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, batched, config.enable_chunked_prefill,
                                   self.eos_token_ids, self.max_model_len)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.device, self.dtype)
        self.sampler = Sampler(self.device, config.seed)
        self.sequences: dict[int, Sequence] = {}
        self.speculator = self._make_speculator(speculative_config, proposer, proposer_factory) \
            if speculative_config else None
        self.timings = StepTimings()
        self._grammars = None  # specd.engine.grammar.Grammars, made on the first constrained request

    def _make_speculator(self, spec: SpeculativeConfig, proposer, proposer_factory):
        from specd.engine.spec.speculator import Speculator

        if proposer is None:
            if proposer_factory is None:
                raise ValueError("speculation needs a proposer: pass one, or a proposer_factory "
                                 "(specd.proposers.factory.in_process_proposer)")
            proposer = proposer_factory(spec, self)
        return Speculator(spec, proposer, self.arch.vocab_size, self.max_model_len)

    # -- setup ---------------------------------------------------------------
    def _max_model_len(self, config: EngineConfig) -> int:
        limit = self.arch.max_position_embeddings
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return config.max_model_len

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        per_seq = -(-self.max_model_len // config.block_size)
        if config.num_kv_blocks is not None:
            blocks = config.num_kv_blocks
        else:
            per_block = ModelRunner.kv_bytes_per_block(self.model, config.block_size, self.dtype)
            if config.kv_cache_gb is not None:
                budget = config.kv_cache_gb * 2**30
            elif self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = free * DEFAULT_GPU_MEMORY_FRACTION
            else:
                budget = kv_memory.default_cpu_budget()
            # No point reserving more than max_num_seqs full-length sequences can use.
            blocks = min(int(budget // per_block), per_seq * config.max_num_seqs)
        if self.device.type == "cpu":
            kv_memory.check_fits(blocks * ModelRunner.kv_bytes_per_block(self.model, config.block_size, self.dtype),
                                 "lower --kv-cache-gb or --num-kv-blocks")
        if blocks < per_seq:
            if config.max_model_len is not None or blocks < 1:  # asked for explicitly: not ours to change
                raise ValueError(f"KV cache of {blocks} blocks x {config.block_size} tokens cannot hold one "
                                 f"sequence of max_model_len {self.max_model_len}; raise the KV budget or "
                                 f"lower max_model_len")
            # The model's own context is only a ceiling: fit it to the cache, as llama.cpp and
            # Ollama fit the context to the machine, instead of refusing to serve.
            log.warning("max_model_len lowered from the model's %d to %d tokens: what a KV cache of %d blocks x "
                        "%d tokens holds (raise --kv-cache-gb or --num-kv-blocks for more)", self.max_model_len,
                        blocks * config.block_size, blocks, config.block_size)
            self.max_model_len = blocks * config.block_size
        return blocks

    # -- requests ------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, seq_id: int | None = None) -> int:
        """The request's sequence id; with params.n > 1, its other choices' sequences are seq.forks
        (this one's n - 1 siblings, choice i drawing from seed + i), which start from its prompt."""
        self.check_prompt(prompt_token_ids)
        self.check_params(params)
        if seq_id is not None and seq_id in self.sequences:
            raise ValueError(f"request id {seq_id} is already in use")
        made: list[Sequence] = []
        try:  # all or nothing: a request that fails to be added leaves no sequence behind
            seq = self._sequence(prompt_token_ids, params, seq_id)
            made.append(seq)
            for i in range(1, params.n):
                made.append(self._sequence(prompt_token_ids, replace(params, seed=None if params.seed is None
                                                                     else params.seed + i), None))
            seq.forks = made[1:]
            self.scheduler.add(seq)
        except BaseException:
            for s in made:
                self.sequences.pop(s.seq_id, None)
            raise
        return seq.seq_id

    def _sequence(self, prompt_token_ids: list[int], params: SamplingParams, seq_id: int | None) -> Sequence:
        seq = Sequence(prompt_token_ids, params, seq_id)
        if params.seed is not None:
            seq.generator = make_generator(params.seed, self.device)
        if params.stop:
            seq.stop_checker = StopChecker(self._stop_tokenizer(), prompt_token_ids, params.stop)
        if params.structured_outputs is not None:
            seq.matcher = self.grammars().matcher(params.structured_outputs)
        self.sequences[seq.seq_id] = seq
        return seq

    def _stop_tokenizer(self) -> Tokenizer:
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = Tokenizer.from_dir(self.model_dir)
        if self._tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer and {self.model_dir} has no tokenizer.json; "
                             "use stop_token_ids")
        return self._tokenizer

    def grammars(self):
        """The grammar engine for this model's tokenizer (structured output)."""
        if self._grammars is None:
            from specd.engine.grammar import Grammars

            path = self.model_dir / "tokenizer.json"
            if not path.is_file():
                raise ValueError(f"structured output needs the model's tokenizer.json and {self.model_dir} has none")
            self._grammars = Grammars(path, self.arch.vocab_size, sorted(self.eos_token_ids))
        return self._grammars

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError for a prompt this engine cannot run (reads constants only: thread-safe)."""
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                             f"{self.max_model_len} (room is needed for at least one new token)")
        vocab = self.arch.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError for settings that name tokens outside this model's vocabulary."""
        vocab = self.arch.vocab_size
        bad = next((t for t in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias names token id {bad}, outside the vocabulary [0, {vocab})")
        # a stop id past the vocabulary would index the logits wherever min_tokens blocks the stops
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids names token id {bad}, outside the vocabulary [0, {vocab})")

    def abort(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id, None)
        if seq is None or seq.is_finished:
            return
        for fork in seq.forks:  # its siblings still waiting for its prompt: they would wait forever
            self.abort(fork.seq_id)
        seq.forks = []
        parent = next((s for s in self.sequences.values() if seq in s.forks), None)
        if parent is not None:  # not started: in no scheduler queue
            parent.forks.remove(seq)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
            self._release(seq)
            return
        self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.sequences.pop(seq.seq_id, None)
        if self.speculator is not None:
            self.speculator.release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def _fork(self, batch: list, logits: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Sequences whose prompt this step completed start their forks (n > 1): each shares the
        prompt's KV (BlockManager.fork) and samples its first token from the prompt's last logits row
        (appended as a row of its own, its entry computing nothing). A fork that finds no block for
        its copy computes its prompt itself (the prefix cache still serves the full blocks)."""
        forks, rows, r = [], [], 0
        for e in batch:
            r += e.num_logits
            if not (e.seq.forks and e.num_logits and e.seq.num_computed_tokens + e.num_new_tokens == len(e.seq)):
                continue
            for child in e.seq.forks:
                if self.block_manager.fork(e.seq, child, len(e.seq), self.runner.copy_kv):
                    self.scheduler.start(child)
                    forks.append(ScheduledSeq(child, 0, 1))
                    rows.append(r - 1)
                else:
                    self.scheduler.add(child)
            e.seq.forks = []
        if not forks:
            return batch, logits
        with torch.inference_mode():
            return batch + forks, torch.cat([logits, logits[torch.tensor(rows, device=logits.device)]])

    # -- the step ------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one engine step; return the sequences that finished in it."""
        if self.speculator is not None:  # before scheduling: prefix hits must come with their features
            self.scheduler.feature_layers = self.speculator.feature_layers
        batch = self.scheduler.schedule()
        if not batch:
            return []
        t0 = time.perf_counter()
        spec = self.speculator
        if spec is not None:
            spec.controller.close_cycle(t0)
            self.runner.capture_layers = spec.feature_layers
            budget_left = self.scheduler.max_num_batched_tokens - sum(e.num_new_tokens for e in batch)
            drafts = spec.propose(batch, budget_left)
            if self._grammars is not None:
                self._grammars.cut_batch_drafts(batch, drafts, self.timings)
            self.scheduler.attach_drafts(batch, drafts)
        t1 = time.perf_counter()
        logits = self.runner.run(batch)  # [Σ num_logits, V] float32
        self.timings.prefill_tokens += sum(min(e.num_new_tokens, len(e.seq.prompt_token_ids) - e.seq.num_computed_tokens)
                                           for e in batch if e.seq.num_computed_tokens < len(e.seq.prompt_token_ids))
        batch, logits = self._fork(batch, logits)
        if self._grammars is not None:
            self._grammars.mask_batch(batch, logits, self.timings)
        meta = SamplingMetadata.from_batch(batch, self.device, **(spec.mode if spec is not None else {}))
        out = self.sampler(apply_penalties(batch, logits, self.eos_token_ids), meta)
        if self._grammars is not None:
            self._grammars.advance(batch, out.token_ids)
        t2 = time.perf_counter()
        num_tokens = sum(e.num_new_tokens for e in batch)
        if spec is not None:
            spec.observe(batch, out.num_accepted)
            # The verify cost model prices decode and verify steps: a prefill chunk's tokens cost far less
            # each (one long sequence), and fitted in, they flattened the line past the table: at batch 32
            # a draft row was priced at a fraction of what it costs, and the suffix index's drafts taken.
            if all(e.num_logits == e.num_new_tokens for e in batch):
                spec.controller.observe_verify(num_tokens, t2 - t1)
        self.timings.observe(t1 - t0, t2 - t1, num_tokens)
        finished = self.scheduler.postprocess(batch, out.token_ids, StepLogprobs(batch, logits), self.runner.features,
                                              self.runner.capture_layers, out.paths, self.runner.copy_kv)
        if spec is not None:
            spec.end_step(batch, t0, t2 - t0, bool(finished))
        for seq in finished:
            self._release(seq)
        return finished
