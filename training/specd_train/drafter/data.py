"""Drafter training data at scale: the target's own conversations, made in resumable shards.

A drafter learns to predict the target, so the best text to learn from is the target's own
(on-policy) answers. Each shard holds `SHARD` conversations and is a pure function of the
target's weights, the shard index and the settings below, never of the batch size or the
machine's speed (batch-invariant decoding and per-request seeds), so a run can stop at any
moment and the next one, on any machine with the same libraries and the same bf16 matmul path
(torch.ops.specd_cpu.bf16_matmul_path: AMX tiles, vdpbf16ps and FMAs round differently), continues
where it stopped.

Prompts come from two places:
- self-asked questions (Magpie, Xu et al. 2024): the target is given its chat template up to
  the start of a user turn and writes the user's question itself, sampled with a per-row
  seed; no corpus is needed, and the questions follow what the model was tuned on;
- the built prompts (prompts.py: questions, code edits, summaries, explanations from the
  stdlib's training split; questions.py: everyday questions), cycled, so code edits and
  summaries stay in the mix.
Held-out benchmark questions (training/specd_train/workloads.py) are refused wherever they appear.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from dataclasses import dataclass
from pathlib import Path

SHARD = 256           # conversations per shard
SELF_ASKED_SHARE = 0.75
QUESTION_TOKENS = 64  # longest self-asked question
QUESTION_TEMPERATURE = 1.0


@dataclass(frozen=True)
class DataConfig:
    max_tokens: int = 256      # longest answer
    dtype: str = "bfloat16"
    version: int = 1           # bump when the recipe changes

    def key(self, target_fingerprint: str) -> str:
        return hashlib.sha256(json.dumps([target_fingerprint, asdict(self)]).encode()).hexdigest()[:16]


def data_dir(target_dir: Path, cfg: DataConfig) -> Path:
    from specd.cache import cache_root
    from specd.cache import file_sha256

    return cache_root() / "drafter-data" / cfg.key(file_sha256(Path(target_dir) / "model.safetensors"))


def shard_path(root: Path, i: int) -> Path:
    return root / f"shard-{i:05d}.pt"


def make_shards(target_dir: Path, shards: int, cfg: DataConfig, batch: int, log=print,
                deadline: float | None = None) -> dict:
    """Make shards 0..shards-1 that are not on disk yet; stop early (cleanly) past `deadline`
    (time.time()). Returns the summary of every shard on disk."""
    from specd.llm import LLM

    root = data_dir(target_dir, cfg)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**asdict(cfg), "target": str(target_dir), "shard": SHARD}, indent=1))
    todo = [i for i in range(shards) if not shard_path(root, i).is_file()]
    if todo:
        from specd.engine.loader import read_arch_config

        positions = read_arch_config(Path(target_dir)).max_position_embeddings
        llm = LLM(str(target_dir), dtype=cfg.dtype, max_num_seqs=batch, max_model_len=min(2048, positions))
        maker = _ShardMaker(llm, cfg)
        for i in todo:
            if deadline is not None and time.time() > deadline:
                log(f"stopping at the deadline before shard {i}; run again to continue")
                break
            shard = maker.make(i, batch)
            tmp = shard_path(root, i).with_suffix(".tmp")
            import torch
            torch.save(shard, tmp)
            os.replace(tmp, shard_path(root, i))  # a killed run never leaves half a shard
            log(f"shard {i}: {shard['answer_tokens']} answer tokens, {shard['question_tokens']} question tokens, "
                f"{shard['seconds']:.0f} s, {shard['tokens_per_s']:.0f} tok/s at batch {batch}")
    return summary(root)


def summary(root: Path) -> dict:
    import torch

    rows = [torch.load(p) for p in sorted(root.glob("shard-*.pt"))]
    return {"dir": str(root), "shards": len(rows),
            "conversations": sum(len(r["ids"]) for r in rows),
            "tokens": sum(sum(len(x) for x in r["ids"]) for r in rows),
            "answer_tokens": sum(r["answer_tokens"] for r in rows),
            "generated_tokens": sum(r["answer_tokens"] + r["question_tokens"] for r in rows),
            "seconds": sum(r["seconds"] for r in rows),
            "per_shard": [{k: v for k, v in r.items() if k not in ("ids", "prompt_lens")} for r in rows]}


def load_sequences(root: Path) -> list:
    """(ids, prompt_len) of every conversation on disk, in shard order."""
    import torch

    out = []
    for p in sorted(root.glob("shard-*.pt")):
        r = torch.load(p)
        out += list(zip(r["ids"], r["prompt_lens"]))
    return out


class _ShardMaker:
    def __init__(self, llm, cfg: DataConfig):
        from specd.models.chat import chat_prompt_ids
        from specd_train.drafter.prompts import training_prompts
        from specd_train.drafter.questions import everyday_questions
        from specd_train.workloads import CHAT_QUESTIONS

        self.llm, self.cfg = llm, cfg
        self.chat_ids = lambda messages: chat_prompt_ids(llm.tokenizer, messages)
        self.built = training_prompts(10**9) + everyday_questions(10**9)
        self.held_out = {q.strip().lower() for q in CHAT_QUESTIONS}
        self.pre_query = self._pre_query_ids()

    def _pre_query_ids(self) -> list[int]:
        """The chat template up to where a user's words would start (its system prompt included)."""
        from specd.models.chat import render_chat
        from specd.models.chat import special_token

        marker = "\x00QUESTION\x00"
        text = render_chat(self.llm.tokenizer, [{"role": "user", "content": marker}], add_generation_prompt=False)
        head = text[: text.index(marker)]
        bos = special_token(self.llm.tokenizer, "bos_token")
        return self.llm.tokenizer.encode(head, add_special_tokens=not (bos and head.startswith(bos)))

    def make(self, i: int, batch: int) -> dict:
        from specd.sampling import SamplingParams
        from specd_train.drafter.answers import answer_params, generate_in_waves

        t0 = time.perf_counter()
        n_asked = round(SHARD * SELF_ASKED_SHARE)
        first = i * SHARD  # global row index: seeds and the built-prompt cycle
        asked = generate_in_waves(self.llm, [self.pre_query] * n_asked,
                               [SamplingParams(temperature=QUESTION_TEMPERATURE, seed=(first + j) * 2 + 1,
                                               max_tokens=QUESTION_TOKENS) for j in range(n_asked)], batch)
        messages, kinds, question_tokens = [], [], 0
        for out in asked:
            question_tokens += len(out.token_ids)
            q = self.llm.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
            if _usable_question(q, out, self.held_out):
                messages.append([{"role": "user", "content": q}])
                kinds.append("self_asked")
        for j in range(SHARD - len(messages)):
            messages.append(self.built[(i * (SHARD - n_asked) + j) % len(self.built)])
            kinds.append("built")
        prompts = [self.chat_ids(m) for m in messages]
        outs = generate_in_waves(self.llm, prompts,
                                 [answer_params(first + j, self.cfg.max_tokens) for j in range(len(prompts))], batch)
        ids = [_as_tensor(p + o.token_ids) for p, o in zip(prompts, outs)]
        answer_tokens = sum(len(o.token_ids) for o in outs)
        seconds = time.perf_counter() - t0
        return {"ids": ids, "prompt_lens": [len(p) for p in prompts], "kinds": kinds,
                "answer_tokens": answer_tokens, "question_tokens": question_tokens, "seconds": seconds,
                "batch": batch, "threads": _threads(),
                "tokens_per_s": (answer_tokens + question_tokens) / seconds}


def _usable_question(q: str, out, held_out: set) -> bool:
    """A whole question (it ended its turn), of a few words, not a held-out benchmark question."""
    return out.finish_reason == "stop" and len(q.split()) >= 3 and q.strip().lower() not in held_out


def _as_tensor(ids: list[int]):
    import torch
    return torch.tensor(ids, dtype=torch.int64)


def _threads() -> int:
    import torch
    return torch.get_num_threads()
