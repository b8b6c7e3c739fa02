"""What the hidden-state heads' trainers share (eagle, eagle3, medusa, mlp_speculator).

The data: the draft_model recipe's training prompts with the target's own answers (cached by
command.py), and the target's hidden states at every position (transformers, bfloat16), in
the engine's convention (specd/engine/model/decoder.py: layer j < L is the input of decoder layer j,
L the final normed state), cached per layer set because a pass over ~800k tokens takes
minutes. Then: batches of whole sequences, the optimiser loop, the draft vocabulary, and the
held-out acceptance replayed through the serving proposer, as the verifier drives it.
"""
from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F


@torch.inference_mode()
def target_features(target, sequences: list[torch.Tensor], log=print, batch: int = 8,
                    layers: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """Per sequence [n, len(layers) * H] bfloat16: the target's states at those layers, side by
    side (None: the final normed state only)."""
    t0, done = time.perf_counter(), 0
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # little padding per batch
    feats: dict[int, torch.Tensor] = {}
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        n = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), n, dtype=torch.long)
        mask = torch.zeros(len(idx), n, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, :len(sequences[i])] = sequences[i]
            mask[b, :len(sequences[i])] = 1
        # right padding: the valid rows are exact
        out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=layers is not None)
        hidden = out.last_hidden_state if layers is None else torch.cat([out.hidden_states[j] for j in layers], -1)
        for b, i in enumerate(idx):
            feats[i] = hidden[b, :len(sequences[i])].to(torch.bfloat16).clone()
        done += int(mask.sum())
        if (start // batch) % 50 == 0:
            log(f"features {start + len(idx)}/{len(order)}: {done / (time.perf_counter() - t0):.0f} tok/s")
    return [feats[i] for i in range(len(sequences))]


def cached_features(target_dir: Path, target, sequences: list[torch.Tensor], layers: tuple[int, ...],
                    log=print) -> list[torch.Tensor]:
    """target_features at `layers`, cached under $SPECD_CACHE/train-drafter/ keyed by the
    target's weights, the sequences and the layers."""
    from specd.cache import cache_root, file_sha256

    h = hashlib.sha256(file_sha256(target_dir / "model.safetensors").encode())
    h.update(repr(layers).encode())
    for s in sequences:
        h.update(s.numpy().tobytes())
    path = cache_root() / "train-drafter" / f"features-{h.hexdigest()[:16]}.pt"
    if path.is_file():
        log(f"features from {path}")
        return torch.load(path)
    feats = target_features(target, sequences, log, layers=layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(feats, path)
    return feats


def batches(n_tokens: list[int], batch_tokens: int, gen: torch.Generator):
    """Whole sequences in a seeded random order, up to ~batch_tokens per batch."""
    order = torch.randperm(len(n_tokens), generator=gen).tolist()
    batch, size = [], 0
    for i in order:
        if batch and size + n_tokens[i] > batch_tokens:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += n_tokens[i]
    if batch:
        yield batch


def train(module: torch.nn.Module, loss_fn, n_tokens: list[int], cfg, log=print) -> dict:
    """AdamW with warmup and cosine decay to 10% over cfg.epochs; loss_fn(batch, noise_gen) ->
    (loss, top-1 agreement with the target). cfg: epochs, batch_tokens, lr, warmup, seed."""
    gen = torch.Generator().manual_seed(cfg.seed)
    noise_gen = torch.Generator().manual_seed(cfg.seed + 1)
    params = [p for p in module.parameters() if p.requires_grad]
    total = sum(1 for _ in batches(n_tokens, cfg.batch_tokens, torch.Generator().manual_seed(0))) * cfg.epochs
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)

    def lr_at(step):
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, total - cfg.warmup))))

    module.train()
    step, t0, history = 0, time.perf_counter(), []
    for epoch in range(cfg.epochs):
        losses, agrees = [], []
        for batch in batches(n_tokens, cfg.batch_tokens, gen):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, agree = loss_fn(batch, noise_gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss.item())
            agrees.append(agree.item())
            step += 1
            if step % 25 == 0:  # losses restart each epoch: the window may be shorter than 25
                recent = min(25, len(losses))
                log(f"step {step}/{total}: loss {sum(losses[-recent:]) / recent:.4f}, top-1 agreement "
                    f"{sum(agrees[-recent:]) / recent:.3f} ({time.perf_counter() - t0:.0f} s)")
        history.append({"loss": sum(losses) / len(losses), "top1_agreement": sum(agrees) / len(agrees)})
        log(f"epoch {epoch + 1}/{cfg.epochs}: {history[-1]} ({time.perf_counter() - t0:.0f} s)")
    module.eval()
    return {"steps": step, "epochs": history, "wall_s": time.perf_counter() - t0}


def draft_vocabulary(seqs, prompt_lens, size: int, vocab: int) -> torch.Tensor | None:
    """The `size` ids most frequent in the answers (ties by id), sorted; None for all."""
    if not size or size >= vocab:
        return None
    counts = torch.zeros(vocab, dtype=torch.long)
    for seq, pl in zip(seqs, prompt_lens):
        counts += torch.bincount(seq[pl:].long(), minlength=vocab)
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]))


def d2t(draft_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's convention for a draft vocabulary: target id = draft id + d2t[draft id]."""
    return (draft_ids - torch.arange(len(draft_ids))).contiguous()


def position_weights(n: int, prompt_len: int, prompt_weight: float) -> torch.Tensor:
    """[n] weights of the positions whose next token is predicted: answer tokens 1, prompt tokens less."""
    w = torch.full((n,), prompt_weight)
    w[max(prompt_len - 1, 0):] = 1.0
    return w


def ahead_targets(seqs, final, prompt_lens, batch: list[int], ahead: int, prompt_weight: float):
    """For heads that draft past the target's next token from one state (Medusa head a, MLP
    speculator stage a, a = 0..ahead): rows j with the state f_j, the tokens x_{j+1} .. x_{j+1+ahead}
    (stage a reads x_{j+1+a}), the target's states f_{j+1+a} that predict what head a must draft
    (x_{j+2+a}), and their weights. -> inputs [N, H], tokens [N, A], goal states [N, A, H],
    weights [N, A] (float32), A = ahead + 1."""
    inp, toks, goal, w = [], [], [], []
    for i in batch:
        n = len(seqs[i]) - 2 - ahead  # j + 2 + ahead must be a position of the sequence
        if n <= 0:
            continue
        f, pw = final[i], position_weights(len(seqs[i]), prompt_lens[i], prompt_weight)
        inp.append(f[:n])
        toks.append(torch.stack([seqs[i][1 + a: 1 + a + n] for a in range(ahead + 1)], 1))
        goal.append(torch.stack([f[1 + a: 1 + a + n] for a in range(ahead + 1)], 1))
        w.append(torch.stack([pw[1 + a: 1 + a + n] for a in range(ahead + 1)], 1))
    return torch.cat(inp).float(), torch.cat(toks).long(), torch.cat(goal).float(), torch.cat(w)


def distill_loss(logits: torch.Tensor, goal_logits: torch.Tensor, weight: torch.Tensor):
    """Weighted cross-entropy to the target's distribution (over the same rows) and top-1 agreement."""
    logq = F.log_softmax(logits.float(), -1)
    p = F.softmax(goal_logits.float(), -1)
    ce = -(p * logq).sum(-1)
    return (ce * weight).sum() / weight.sum(), (logq.argmax(-1) == p.argmax(-1)).float().mean()


def ahead_loss(logits: list[torch.Tensor], goal: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
               decay: float):
    """Draft a's distillation loss (logits[a] against the target's rows on goal[:, a], weights
    weight[:, a]) weighted decay ** a, as Medusa weighs its heads; and the first draft's top-1 agreement."""
    total, norm, agree = 0.0, 0.0, []
    for a, lg in enumerate(logits):
        with torch.no_grad():
            goal_logits = goal[:, a] @ rows.T
        loss, ag = distill_loss(lg, goal_logits, weight[:, a])
        total, norm = total + decay ** a * loss, norm + decay ** a
        agree.append(ag)
    return total / norm, agree[0]


def write_checkpoint(out: Path, file: str, state: dict[str, torch.Tensor], config: dict) -> None:
    """A head directory: its tensors as `file` (safetensors) and config.json."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / file), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@torch.inference_mode()
def acceptance(proposer, seqs, feats, prompt_lens, k: int) -> dict:
    """Greedy speculation replayed through the serving proposer on the target's own greedy
    answers: after the prefill (prompt + the target's first token) each step sends the newly
    committed tokens with the rows that predicted them (feats: None for a drafter that reads
    none), as the verifier does; the drafts are
    accepted while they equal the answer, then the answer's next token is committed too."""
    from specd.proposers.base import ProposeRequest

    accepted_at, offered_at = [0] * k, [0] * k
    steps = tokens = 0
    for sid, (seq, f, pl) in enumerate(zip(seqs, feats, prompt_lens)):
        ids, n = seq.tolist(), len(seq)
        done, c = 0, pl + 1
        while c < n:
            full = done == 0
            req = ProposeRequest(seq_id=sid, new_tokens=ids[done:c], num_tokens=c, k=min(k, n - c), full_history=full,
                                 features=None if f is None else f[0 if full else done - 1: c - 1],
                                 feature_layers=getattr(proposer, "feature_layers", ()))
            drafts = proposer.propose([req])[0].token_ids
            j = 0
            while j < len(drafts) and drafts[j] == ids[c + j]:
                j += 1
            for pos in range(min(j + 1, len(drafts))):  # offered: every earlier draft was accepted
                offered_at[pos] += 1
            for pos in range(j):
                accepted_at[pos] += 1
            steps += 1
            tokens += min(j + 1, n - c)
            done, c = c, c + j + 1
        proposer.release([sid])
    alpha = [a / o if o else 0.0 for a, o in zip(accepted_at, offered_at)]
    return {"k": k, "alpha_per_position": alpha, "tokens_per_step": tokens / max(1, steps),
            "alpha": sum(accepted_at) / max(1, sum(offered_at))}


def columns(feats: list[torch.Tensor], layers: tuple[int, ...], wanted: tuple[int, ...], hidden: int):
    """The `wanted` layers' columns of features captured at `layers` (in the order wanted)."""
    cols = torch.cat([torch.arange(layers.index(j) * hidden, (layers.index(j) + 1) * hidden) for j in wanted])
    return [f[:, cols] for f in feats]


def feature_layers(num_layers: int) -> tuple[int, ...]:
    """What one cached pass captures for every head: EAGLE-3's default three layers (as vLLM and
    SGLang pick them: 2, L // 2, L - 3) and the final normed state L (eagle, medusa, mlp_speculator)."""
    return (2, num_layers // 2, num_layers - 3, num_layers)


def prepare(target_dir: Path, args, log=print) -> dict:
    """Training answers and held-out greedy answers, with the target's features at
    feature_layers(L) ("layers"), and the final normed state alone ("final")."""
    from transformers import AutoModelForCausalLM

    from specd.models.chat import chat_prompt_ids
    from specd.engine.loader import read_arch_config
    from specd.models.tokenizer import Tokenizer
    from specd_train.drafter.answers import cached_answers, training_answers
    from specd_train.workloads import WORKLOADS, workload

    arch = read_arch_config(target_dir)
    layers = feature_layers(arch.num_layers)
    tok = Tokenizer.from_dir(target_dir)
    prompts, seqs = training_answers(target_dir, args, log)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    feats = cached_features(target_dir, target, seqs, layers, log)
    data = {"prompts": prompts, "seqs": seqs, "prompt_lens": [len(chat_prompt_ids(tok, m)) for m in prompts],
            "layers": layers, "feats": feats, "heldout": {},
            "final": columns(feats, layers, (arch.num_layers,), arch.hidden_size)}
    for name in WORKLOADS:
        msgs = workload(name, args.eval_prompts)
        hs = cached_answers(target_dir, msgs, args, log, greedy_only=True, dtype="float32")
        data["heldout"][name] = (hs, target_features(target, hs, log, layers=layers),
                                 [len(chat_prompt_ids(tok, m)) for m in msgs])
    return data
