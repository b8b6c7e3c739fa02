"""Training an EAGLE-3 head for a target (EAGLE-3's recipe, with training-time test, on the
target's own answers).

The head reads pairs (the target's states at three layers at position j, side by side, the
token x_{j+1}): `fc` fuses the three into one state g_j; one decoder layer whose attention reads
[norm(embedding of x_{j+1}), norm(g_j)] turns pair j into an output o_j that drafts x_{j+2}
through the head's norm and LM head (a draft vocabulary). While drafting, the next pair is the
drafted token with o_j itself in place of g (no fc): training-time test runs that too. Step 0
is the pairs from the target; at step s, pair j reads the step s-1 output at j-1 with the
answer's token x_{j+1}, and attends to the target-fed pairs up to j - s and to its own chain
(step t's pair j - s + t), as the serving head's KV cache holds them. Loss: cross-entropy to
the target's distribution at j+1 over the draft vocabulary, at every step, equally weighted.

Starts: fc picks the last of the three layers, the decoder layer is the target's last layer
(q/k/v read half embedding, half state) with its output projections zeroed, the LM head the
target's rows of the draft vocabulary, so the untrained head is the "logit lens" on layer
L - 3. Saved in the yuhuili/EAGLE3 layout (config.json with draft_vocab_size; fc, midlayer.*,
norm, lm_head, d2t, t2d) with eagle_aux_hidden_state_layer_ids and the target's fingerprint.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specd_train.drafter import head_training as ht
from specd_train.drafter import precision


@dataclass(frozen=True)
class Eagle3Config:
    ttt_steps: int = 3
    epochs: int = 1
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup: int = 20
    prompt_weight: float = 0.25
    draft_vocab: int = 8192
    seed: int = 0


class _Attention(nn.Module):
    def __init__(self, tc):
        super().__init__()
        h, d = tc.hidden_size, tc.hidden_size // tc.num_attention_heads
        self.nh, self.nkv, self.d = tc.num_attention_heads, tc.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.nh * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nh * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, tc):
        super().__init__()
        self.gate_proj = nn.Linear(tc.hidden_size, tc.intermediate_size, bias=False)
        self.up_proj = nn.Linear(tc.hidden_size, tc.intermediate_size, bias=False)
        self.down_proj = nn.Linear(tc.intermediate_size, tc.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    """yuhuili's `midlayer`: its parameter names are the checkpoint's."""

    def __init__(self, tc):
        super().__init__()
        eps = tc.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(tc.hidden_size, eps=eps)  # on the token embedding
        self.hidden_norm = nn.RMSNorm(tc.hidden_size, eps=eps)  # on the state
        self.self_attn = _Attention(tc)
        self.post_attention_layernorm = nn.RMSNorm(tc.hidden_size, eps=eps)
        self.mlp = _MLP(tc)


class Eagle3TrainHead(nn.Module):
    def __init__(self, target, num_aux: int, lm_rows: torch.Tensor):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        super().__init__()
        tc = target.config
        h = tc.hidden_size
        self.fc = nn.Linear(num_aux * h, h, bias=False)
        self.midlayer = _MidLayer(tc)
        self.norm = nn.RMSNorm(h, eps=tc.rms_norm_eps)
        self.lm_head = nn.Linear(h, lm_rows.shape[0], bias=False)
        last = target.model.layers[-1]
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, (num_aux - 1) * h:] = torch.eye(h)
            attn = self.midlayer.self_attn
            for mine, theirs in ((attn.q_proj, last.self_attn.q_proj), (attn.k_proj, last.self_attn.k_proj),
                                 (attn.v_proj, last.self_attn.v_proj)):
                mine.weight.copy_(0.5 * torch.cat([theirs.weight, theirs.weight], 1))
            self.midlayer.mlp.load_state_dict(last.mlp.state_dict())
            attn.o_proj.weight.zero_()
            self.midlayer.mlp.down_proj.weight.zero_()
            self.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
            self.norm.weight.copy_(target.model.norm.weight)
            self.lm_head.weight.copy_(lm_rows)
        self.rotary = LlamaRotaryEmbedding(tc)
        self.register_buffer("embed", target.model.embed_tokens.weight.detach().float(), persistent=False)
        # the teacher: the target's own LM head rows (lm_head trains away from them)
        self.register_buffer("goal_rows", lm_rows.detach().float().clone(), persistent=False)

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, T] (x_{j+1} of pair j), feats [B, T, num_aux * H] (the target's states at j)
        -> the outputs of each step, [B, T, H] each (step s is valid from pair s on)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        B, T = tokens.shape
        layer, attn = self.midlayer, self.midlayer.self_attn
        emb = layer.input_layernorm(self.embed[tokens])
        pos = torch.arange(T)[None]
        hidden = self.fc(feats)
        cos, sin = self.rotary(hidden, pos)
        j, i = torch.arange(T)[:, None], torch.arange(T)[None, :]
        keys, values, outs = [], [], []
        for s in range(steps):
            if s:  # pair j reads the previous step's output at j - 1
                hidden = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)
            x = torch.cat([emb, layer.hidden_norm(hidden)], -1)
            q = attn.q_proj(x).view(B, T, attn.nh, attn.d).transpose(1, 2)
            k = attn.k_proj(x).view(B, T, attn.nkv, attn.d).transpose(1, 2)
            v = attn.v_proj(x).view(B, T, attn.nkv, attn.d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys.append(k)
            values.append(v)
            # step 0's keys up to j - s, then step t's key at j - s + t (the query's own chain)
            mask = torch.cat([i <= j - s] + [i == j - s + t for t in range(1, s + 1)], 1)
            rep = attn.nh // attn.nkv
            o = F.scaled_dot_product_attention(q, torch.cat(keys, 2).repeat_interleave(rep, 1),
                                               torch.cat(values, 2).repeat_interleave(rep, 1), attn_mask=mask)
            out = hidden + attn.o_proj(o.transpose(1, 2).reshape(B, T, attn.nh * attn.d))
            outs.append(out + layer.mlp(layer.post_attention_layernorm(out)))
        return outs

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def loss(self, seqs, feats, final, prompt_lens, batch, cfg: Eagle3Config):
        T = max(len(seqs[i]) for i in batch) - 1
        B = len(batch)
        tokens = torch.zeros(B, T, dtype=torch.long)
        inp = torch.zeros(B, T, feats[batch[0]].shape[1])
        goal = torch.zeros(B, T, final[batch[0]].shape[1])
        weight = torch.zeros(B, T)
        for b, i in enumerate(batch):
            n = len(seqs[i]) - 1
            tokens[b, :n] = seqs[i][1:]
            inp[b, :n] = feats[i][:-1].float()
            goal[b, :n] = final[i][1:].float()  # f_{j+1}: the target's distribution of x_{j+2}
            weight[b, :n] = ht.position_weights(n + 1, prompt_lens[i], cfg.prompt_weight)[1:]
        total, agree0 = 0.0, None
        with precision.autocast():
            outs = self.forward(tokens, inp, cfg.ttt_steps)
            for s, out in enumerate(outs):
                w = weight.clone()
                w[:, :s] = 0  # pair j exists at step s only from j = s on
                valid = w > 0
                with torch.no_grad():
                    goal_logits = goal[valid] @ self.goal_rows.T
                loss, agree = ht.distill_loss(self.logits(out[valid]), goal_logits, w[valid])
                total = total + loss / len(outs)
                agree0 = agree if agree0 is None else agree0
        return total, agree0

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}


def save(head: Eagle3TrainHead, target_config, out, fingerprint: str, cfg: Eagle3Config, aux: tuple[int, ...],
         draft_ids: torch.Tensor) -> None:
    state = head.state_for_checkpoint()
    state["d2t"] = ht.d2t(draft_ids)
    t2d = torch.zeros(target_config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    state["t2d"] = t2d
    config = target_config.to_dict()
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], torch_dtype="bfloat16",
                  draft_vocab_size=len(draft_ids), target_hidden_size=target_config.hidden_size,
                  eagle_aux_hidden_state_layer_ids=list(aux), specd_target_fingerprint=fingerprint,
                  specd_eagle3={"recipe": "EAGLE-3 with training-time test", **asdict(cfg)})
    config.pop("dtype", None)
    ht.write_checkpoint(out, "model.safetensors", state, config)


def train_eagle3(target_dir, out, args, log=print) -> dict:
    """The whole run: answers and features (cached) -> train -> checkpoint -> held-out acceptance."""
    import time

    from transformers import AutoModelForCausalLM

    from specd.engine.loader import read_arch_config
    from specd_train.drafter.head_card import finish_head, lm_rows

    t0 = time.perf_counter()
    cfg = Eagle3Config(**({"epochs": args.epochs} if args.epochs else {}))
    arch = read_arch_config(target_dir)
    data = ht.prepare(target_dir, args, log)
    aux = data["layers"][:3]
    seqs, pls, final = data["seqs"], data["prompt_lens"], data["final"]
    feats = ht.columns(data["feats"], data["layers"], aux, arch.hidden_size)
    del data["feats"]
    draft_ids = ht.draft_vocabulary(seqs, pls, cfg.draft_vocab, arch.vocab_size)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    head = Eagle3TrainHead(target, len(aux), lm_rows(target_dir, draft_ids))
    report = ht.train(head, lambda batch, _gen: head.loss(seqs, feats, final, pls, batch, cfg),
                      [len(s) for s in seqs], cfg, log)
    return finish_head("eagle3", target_dir, out, args, data, report, cfg, t0,
                       lambda fp: save(head, target.config, out, fp, cfg, aux, draft_ids), log)
