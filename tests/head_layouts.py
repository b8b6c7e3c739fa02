"""Random-weight head checkpoints in each published layout, and a reference per layout computed
from the raw tensors as the publishing project's architecture defines it (no specd code).

Reference.chain(tokens, rows, k, forced=None) -> (drafts, logits per step in target-id space):
rows[i] is the target's state that predicted tokens[i + 1]; greedy drafts take the argmax,
`forced` drafts are followed instead (to compare sampled runs step by step).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

LAYOUTS = ["eagle", "eagle_speculators", "eagle3", "eagle3_speculators", "eagle3_speculators_norms", "medusa_pt",
           "medusa_st", "mlp", "mlp_tied"]
DRAFT_VOCAB = 48


def head_target(out: Path, max_positions: int = 128):
    """The 8-layer target (vocab 96) the heads are written for, saved to `out` -> (dir, model)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                   initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    return str(out), model


def _rand(*shape, std=0.2):
    return std * torch.randn(*shape)


def _norm_w(n):
    return 1.0 + 0.1 * torch.randn(n)


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _layer_cfg(target, layers=1, **kw):
    import transformers

    t = target.config
    return transformers.LlamaConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=48,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=256, rms_norm_eps=1e-6, **kw)


def _hf_layer(cfg, in_dim=None):
    """transformers' LlamaDecoderLayer with random weights (q/k/v reading in_dim for EAGLE-3)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, 0)
    if in_dim:
        a = layer.self_attn
        a.q_proj = torch.nn.Linear(in_dim, a.q_proj.out_features, bias=False)
        a.k_proj = torch.nn.Linear(in_dim, a.k_proj.out_features, bias=False)
        a.v_proj = torch.nn.Linear(in_dim, a.v_proj.out_features, bias=False)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(_norm_w(p.shape[0]) if name.endswith("norm.weight") else _rand(*p.shape))
    return layer.eval()


def _save(d: Path, cfg: dict, tensors: dict, file: str):
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if file.endswith(".safetensors"):
        save_file(tensors, str(d / file))
    else:
        torch.save(tensors, d / file)


class _Causal:
    """Runs transformers' layers over a whole pair sequence (positions 0..n-1, causal mask)."""

    def __init__(self, cfg):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary = LlamaRotaryEmbedding(cfg)

    def inputs(self, x):
        n = x.shape[1]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return dict(attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, pos))


class EagleRef:
    def __init__(self, fc_w, fc_b, layers, embed, lm_head, cfg, emb_ln=None, pre_lm_ln=None, feature_layers=()):
        self.fc_w, self.fc_b, self.layers, self.embed, self.lm_head = fc_w, fc_b, layers, embed, lm_head
        self.emb_ln, self.pre_lm_ln, self.causal = emb_ln, pre_lm_ln, _Causal(cfg)
        self.feature_layers = feature_layers

    def run(self, tokens, hidden):  # EAGLE-1: target rows and fed-back outputs alike through fc
        e = self.embed[torch.tensor(tokens)]
        if self.emb_ln is not None:
            e = _rms(e, self.emb_ln)
        x = F.linear(torch.cat([e, hidden], -1), self.fc_w, self.fc_b)[None]
        kw = self.causal.inputs(x)
        for layer in self.layers:
            x = layer(x, **kw)
        return x[0]

    def logits(self, h):
        return (h if self.pre_lm_ln is None else _rms(h, self.pre_lm_ln)) @ self.lm_head.T

    def chain(self, tokens, rows, k, forced=None):
        with torch.no_grad():
            toks, hid = list(tokens[1:]), [r for r in rows]
            h = self.run(toks, torch.stack(hid))[-1]
            drafts, all_logits = [], []
            for i in range(k):
                lg = self.logits(h)
                d = forced[i] if forced else int(lg.argmax())
                drafts.append(d)
                all_logits.append(lg)
                toks.append(d)
                hid.append(h)
                h = self.run(toks, torch.stack(hid))[-1]
            return drafts, all_logits


class Eagle3Ref(EagleRef):
    def __init__(self, fc_w, layers, embed, cfg, hidden_norm, norm, lm_head, d2t, nbr, feature_layers,
                 fc_norms=None, norm_output=False):
        super().__init__(fc_w, None, layers, embed, lm_head, cfg, feature_layers=feature_layers)
        self.hidden_norm, self.norm, self.d2t, self.nbr = hidden_norm, norm, d2t, nbr
        self.fc_norms, self.norm_output = fc_norms, norm_output

    def _fc(self, v):  # a target row: [norm_j(layer j) for each j] (fc_norm), then fc
        if self.fc_norms is not None:
            v = torch.cat([_rms(c, w) for c, w in zip(v.chunk(len(self.fc_norms)), self.fc_norms)])
        return F.linear(v, self.fc_w)

    def run(self, tokens, hidden, from_target):
        e = self.embed[torch.tensor(tokens)]
        h = torch.stack([self._fc(v) if t else v for v, t in zip(hidden, from_target)])[None]
        first = self.layers[0]
        kw = self.causal.inputs(h)
        hn = _rms(h, self.hidden_norm)
        attn_in = torch.cat([first.input_layernorm(e[None]), hn], -1)
        x = (hn if self.nbr else h) + first.self_attn(attn_in, kw["position_embeddings"], kw["attention_mask"])[0]
        x = x + first.mlp(first.post_attention_layernorm(x))
        for layer in self.layers[1:]:
            x = layer(x, **kw)
        return _rms(x[0], self.norm) if self.norm_output else x[0]  # norm_output: fed back normed

    def logits(self, h):  # draft vocabulary scattered into target ids (the rest -inf)
        full = torch.full((self.embed.shape[0],), float("-inf"))
        full[torch.arange(DRAFT_VOCAB) + self.d2t] = (h if self.norm_output else _rms(h, self.norm)) @ self.lm_head.T
        return full

    def chain(self, tokens, rows, k, forced=None):
        with torch.no_grad():
            toks, hid, tgt = list(tokens[1:]), [r for r in rows], [True] * len(rows)
            h = self.run(toks, hid, tgt)[-1]
            drafts, all_logits = [], []
            for i in range(k):
                lg = self.logits(h)
                d = forced[i] if forced else int(lg.argmax())
                drafts.append(d)
                all_logits.append(lg)
                toks.append(d)
                hid.append(h)
                tgt.append(False)
                h = self.run(toks, hid, tgt)[-1]
            return drafts, all_logits


class MedusaRef:
    def __init__(self, blocks, outs, L):
        self.blocks, self.outs, self.feature_layers = blocks, outs, (L,)

    def chain(self, tokens, rows, k, forced=None):
        logits = []
        for i in range(k):
            x = rows[-1]
            for w, b in self.blocks[i]:
                x = x + F.silu(x @ w.T + b)
            logits.append(x @ self.outs[i].T)
        drafts = list(forced) if forced else [int(lg.argmax()) for lg in logits]
        return drafts, logits


class MLPRef:
    def __init__(self, t, n, inner, scale_input, tied, L):
        self.t, self.n, self.inner, self.scale_input, self.tied = t, n, inner, scale_input, tied
        self.feature_layers = (L,)

    def chain(self, tokens, rows, k, forced=None):
        sw = 0.5 ** (0.5 / self.n)
        ew = math.sqrt((1 - sw ** 2) * (self.inner / 2))
        state, token, drafts, logits = rows[-1], tokens[-1], [], []
        if self.scale_input:
            state = state / state.pow(2).mean().add(1e-6).sqrt() / math.sqrt(2)
        for i in range(k):
            s, p = (0, min(i, 1)) if self.tied else (i, i)
            x = self.t[f"proj.{p}.weight"] @ state + (ew / sw) * self.t[f"emb.{s}.weight"][token]
            x = x / x.pow(2).mean().add(1e-6).sqrt() * self.t[f"ln.{s}.weight"] + self.t[f"ln.{s}.bias"]
            state = F.gelu(x)
            lg = self.t[f"head.{s}.weight"] @ state
            token = forced[i] if forced else int(lg.argmax())
            drafts.append(token)
            logits.append(lg)
        return drafts, logits


def write_layout(name: str, d: Path, target):
    """Write the checkpoint of layout `name` into d; return (method, d, reference)."""
    torch.manual_seed(sum(map(ord, name)))
    V, H, L = target.config.vocab_size, target.config.hidden_size, target.config.num_hidden_layers
    embed = target.model.embed_tokens.weight.detach().clone()
    lm_head = target.lm_head.weight.detach().clone()
    if name in ("eagle", "eagle_speculators"):
        speculators = name == "eagle_speculators"
        cfg = _layer_cfg(target)
        layer = _hf_layer(cfg)
        fc_w, fc_b = _rand(H, 2 * H), _rand(H)
        t = {f"layers.0.{k}": v for k, v in layer.state_dict().items() if not k.startswith("input_layernorm")}
        t.update({"fc.weight": fc_w, "fc.bias": fc_b, "embed_tokens.weight": embed})
        emb_ln = pre_ln = None
        if speculators:  # HASS-style: layernorms + fusion bias, speculators' names
            emb_ln, pre_ln = _norm_w(H), _norm_w(H)
            t = {k.replace("layers.0.", "transformer.").replace("fc.", "fusion_fc."): v for k, v in t.items()
                 if k != "embed_tokens.weight"}
            t.update({"transformer.input_layernorm.weight": layer.input_layernorm.weight.detach().clone(),
                      "embedding_layernorm.weight": emb_ln, "pre_lm_head_layernorm.weight": pre_ln})
            config = {"architectures": ["EagleSpeculator"], "speculators_model_type": "eagle",
                      "transformer_layer_config": cfg.to_diff_dict(), "layernorms": True, "fusion_bias": True,
                      "speculators_config": {"algorithm": "eagle", "default_proposal_method": "greedy",
                                             "proposal_methods": [{"proposal_type": "greedy",
                                                                   "speculative_tokens": 3}],
                                             "verifier": {"name_or_path": "tiny-target",
                                                          "architectures": ["LlamaForCausalLM"]}}}
            _save(d, config, t, "model.safetensors")
        else:  # yuhuili/EAGLE-*: a Llama config, pytorch_model.bin, layer 0 without input_layernorm
            layer.input_layernorm = torch.nn.Identity()
            _save(d, {**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}, t, "pytorch_model.bin")
        return "eagle", d, EagleRef(fc_w, fc_b, [layer], embed, lm_head, cfg, emb_ln, pre_ln, (L,))
    if name.startswith("eagle3"):
        speculators, norms = name.startswith("eagle3_speculators"), name.endswith("_norms")
        layers_ids = [1, 3, 6] if speculators else [2, L // 2, L - 3]
        cfg = _layer_cfg(target, layers=2 if speculators else 1)
        layers = [_hf_layer(cfg, in_dim=2 * H)] + ([_hf_layer(cfg)] if speculators else [])
        fc_w, hidden_norm, norm = _rand(H, 3 * H), _norm_w(H), _norm_w(H)
        lm = _rand(DRAFT_VOCAB, H, std=0.5)
        chosen = torch.randperm(V)[:DRAFT_VOCAB].sort().values
        d2t = chosen - torch.arange(DRAFT_VOCAB)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[chosen] = True
        t = {"fc.weight": fc_w, "norm.weight": norm, "lm_head.weight": lm, "d2t": d2t, "t2d": t2d}
        prefix = "layers.0." if speculators else "midlayer."
        t.update({prefix + k: v for k, v in layers[0].state_dict().items()})
        t[prefix + "hidden_norm.weight"] = hidden_norm
        fc_norms = [_norm_w(H) for _ in range(3)] if norms else None
        if speculators:
            t.update({"layers.1." + k: v for k, v in layers[1].state_dict().items()})
            t.update({f"fc_norm.{j}.weight": w for j, w in enumerate(fc_norms or [])})
            config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                      "transformer_layer_config": cfg.to_diff_dict(), "draft_vocab_size": DRAFT_VOCAB,
                      "norm_before_residual": not norms, "fc_norm": norms, "norm_output": norms,
                      "eagle_aux_hidden_state_layer_ids": layers_ids,
                      "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                             "proposal_methods": [{"proposal_type": "greedy",
                                                                   "speculative_tokens": 3}],
                                             "verifier": {"name_or_path": "tiny-target",
                                                          "architectures": ["LlamaForCausalLM"]}}}
            _save(d, config, t, "model.safetensors")
        else:  # yuhuili/EAGLE3-*: Llama config + draft_vocab_size, pytorch_model.bin
            _save(d, {**cfg.to_dict(), "architectures": ["LlamaForCausalLMEagle3"],
                      "draft_vocab_size": DRAFT_VOCAB}, t, "pytorch_model.bin")
        ref = Eagle3Ref(fc_w, layers, embed, cfg, hidden_norm, norm, lm, d2t, speculators and not norms,
                        tuple(layers_ids), fc_norms, norms)
        return "eagle3", d, ref
    if name.startswith("medusa"):
        heads, layers = 3, (1 if name == "medusa_pt" else 2)
        blocks = [[(_rand(H, H), _rand(H)) for _ in range(layers)] for _ in range(heads)]
        outs = [_rand(V, H, std=0.5) for _ in range(heads)]
        t = {}
        for i in range(heads):
            for j, (w, b) in enumerate(blocks[i]):
                t[f"{i}.{j}.linear.weight"], t[f"{i}.{j}.linear.bias"] = w, b
            t[f"{i}.{layers}.weight"] = outs[i]
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny-target"}
        _save(d, config, t, "medusa_lm_head.pt" if name == "medusa_pt" else "medusa_lm_head.safetensors")
        return "medusa", d, MedusaRef(blocks, outs, L)
    tied, n, inner = name == "mlp_tied", 3, 24
    t = {}
    for i in range(1 if tied else n):
        t[f"emb.{i}.weight"], t[f"head.{i}.weight"] = _rand(V, inner, std=1.0), _rand(V, inner, std=0.5)
        t[f"ln.{i}.weight"], t[f"ln.{i}.bias"] = _norm_w(inner), _rand(inner, std=0.1)
    for i in range(2 if tied else n):
        t[f"proj.{i}.weight"] = _rand(inner, H if i == 0 else inner)
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "emb_dim": H,
              "inner_dim": inner, "n_predict": n, "vocab_size": V, "top_k_tokens_per_head": [1] * n,
              "n_candidates": 1, "tie_weights": tied, "scale_input": not tied}
    _save(d, config, {("speculator." + k if tied else k): v for k, v in t.items()}, "model.safetensors")
    return "mlp_speculator", d, MLPRef(t, n, inner, not tied, tied, L)
