"""Shared fixtures: tiny random Llama-family checkpoints and a Hugging Face reference.

Every checkpoint is built once per session with transformers' own config classes and
`save_pretrained` (safetensors, float32), so the engine is tested against exactly
the files a real hub download would give. Weights are drawn with a larger std than
the default (initializer_range=0.1) so logits are spread out: greedy runs do not
hinge on near-ties that float32 rounding could flip.

Helpers are exposed as fixtures (`hf_greedy`, `hf_logits`, `make_prompts`) rather
than imported from this file, so test modules never import conftest.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from functools import lru_cache
from pathlib import Path

# The CI machine is shared; one thread keeps timings stable and the suite polite.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton reads TRITON_INTERPRET when it is first imported, and transformers (used by the
# demo and parity tests, which run before tests/kernels) imports it: so set it here,
# before anything else, on machines without a GPU.
import torch  # noqa: E402  (does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests never touch the network: a missing local path must fail fast, not try the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(1)

VOCAB = 512
EOS_ID = 2
BOS_ID = 1

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per kv head
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=0,
)

# family -> (transformers config class name, extra config kwargs, save kwargs)
FAMILY_SPECS: dict[str, tuple[str, dict, dict]] = {
    # plain Llama, untied, sharded into several safetensors files + index, with a tokenizer
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False), dict(max_shard_size="60KB")),
    # Llama 3 rope scaling, tied embeddings
    "llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        {},
    ),
    # Qwen2: qkv bias (always on), tied embeddings
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), {}),
    # Qwen3: q/k RMSNorm, head_dim (32) != hidden/heads (16), untied
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32), {}),
    # Mistral, untied
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False), {}),
}
FAMILIES = list(FAMILY_SPECS)


def _build_model(family: str, out_dir: Path, seed: int) -> Path:
    import transformers

    cls_name, extra, save_kwargs = FAMILY_SPECS[family]
    cfg = getattr(transformers, cls_name)(**_COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Norm weights init to 1 and biases to 0; give them some spread too so a
    # wrong bias/norm wiring shows up in the outputs.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    return out_dir


def _save_word_tokenizer(out_dir: Path) -> None:
    """A WordLevel tokenizer "w3 w4 ..." over the whole vocab (ids 0-2: unk, bos, eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out_dir)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def model_dirs(model_root) -> dict[str, str]:
    """family -> directory of a saved tiny random checkpoint (built once per session)."""
    dirs = {}
    for i, family in enumerate(FAMILIES):
        d = _build_model(family, model_root / family, seed=1000 + i)
        if family == "llama":
            _save_word_tokenizer(d)
        dirs[family] = str(d)
    return dirs


@pytest.fixture(scope="session", params=FAMILIES)
def family_dir(request, model_dirs) -> str:
    """Parametrized over every supported family."""
    return model_dirs[request.param]


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    """Plain Llama: untied, sharded, has a tokenizer."""
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def unsupported_model_dir(model_root) -> str:
    """A real GPT-2 checkpoint: a well-formed model of an architecture we do not support."""
    import transformers

    d = model_root / "gpt2"
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d, safe_serialization=True)
    return str(d)


def with_eos(src: str, dst: Path, eos_token_id: int) -> str:
    """Copy a checkpoint dir with its eos_token_id replaced (config + generation config)."""
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        p = dst / name
        if p.exists():
            cfg = json.loads(p.read_text())
            cfg["eos_token_id"] = eos_token_id
            p.write_text(json.dumps(cfg, indent=2))
    return str(dst)


@pytest.fixture(scope="session")
def model_with_eos(tmp_path_factory):
    """Factory: (src_dir, eos_token_id) -> copy of src whose EOS is that token."""

    def make(src: str, eos_token_id: int) -> str:
        return with_eos(src, tmp_path_factory.mktemp("eos") / "model", eos_token_id)

    return make


# ---------------------------------------------------------------- HF reference


@lru_cache(maxsize=None)
def load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@lru_cache(maxsize=None)
def _hf_greedy_cached(model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool):
    model = load_hf(model_dir)
    gen_cfg = model.generation_config
    saved = gen_cfg.eos_token_id
    if ignore_eos:
        # transformers merges an eos_token_id=None argument with the model's default;
        # clearing the model's own generation config is what really turns EOS off.
        gen_cfg.eos_token_id = None
    try:
        ids = torch.tensor([list(prompt_ids)])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
    finally:
        gen_cfg.eos_token_id = saved
    return tuple(out[0, ids.shape[1]:].tolist())


def hf_greedy(model_dir: str, prompt_ids, max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    """transformers `generate(do_sample=False)` in float32 for one prompt; new tokens only.

    With ignore_eos (default) it always returns max_new_tokens tokens; without, it
    stops after the model's EOS (the EOS itself included, as the engine reports it).
    """
    return list(_hf_greedy_cached(str(model_dir), tuple(int(t) for t in prompt_ids), max_new_tokens, ignore_eos))


def hf_logits(model_dir: str, token_ids) -> torch.Tensor:
    """transformers forward in float32: logits [len(token_ids), vocab] for one sequence."""
    model = load_hf(str(model_dir))
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float()


@pytest.fixture(scope="session", name="hf_greedy")
def hf_greedy_fixture():
    return hf_greedy


@pytest.fixture(scope="session", name="hf_logits")
def hf_logits_fixture():
    return hf_logits


def make_prompts(n: int, seed: int = 0, vocab: int = VOCAB, lengths=None, max_len: int = 100) -> list[list[int]]:
    """n random token-id prompts of mixed lengths (seeded). Special ids 0-2 are avoided.

    Lengths always include 1 and the block-boundary neighbours 15/16/17, 31/32/33 when n allows.
    """
    rng = random.Random(seed)
    if lengths is None:
        fixed = [1, 2, 15, 16, 17, 31, 32, 33, 64, max_len]
        lengths = [x for x in fixed if x <= max_len][:n]
        lengths += [rng.randint(1, max_len) for _ in range(n - len(lengths))]
        rng.shuffle(lengths)
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="session", name="make_prompts")
def make_prompts_fixture():
    return make_prompts


@pytest.fixture(scope="session")
def specd_cli() -> list[str]:
    """argv prefix that runs the installed `specd` console script of this interpreter's venv."""
    import sys

    script = Path(sys.executable).parent / "specd"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from specd.cli import main; sys.exit(main())"]


@pytest.fixture(scope="session")
def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


# ---------------------------------------------------------------- engine


@pytest.fixture(scope="session")
def get_llm():
    """Factory with a per-session cache: get_llm(model_dir, **engine_kwargs) -> specd.LLM.

    Always float32 on CPU (the parity reference). Tests that inspect or disturb engine
    state (KV blocks, preemption counters, aborts) should pass fresh=True.
    """
    cache: dict = {}

    def get(model_dir: str, fresh: bool = False, **kwargs):
        from specd import LLM

        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        key = (str(model_dir), tuple(sorted(kwargs.items())))
        if fresh:
            return LLM(str(model_dir), **kwargs)
        if key not in cache:
            cache[key] = LLM(str(model_dir), **kwargs)
        return cache[key]

    return get


def first_divergence(a, b) -> str:
    """Human-readable first mismatch between two token lists (for assertion messages)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first mismatch at new token {i}: {x} != {y} (len {len(a)} vs {len(b)})"
    return f"same prefix, lengths {len(a)} vs {len(b)}"


@pytest.fixture(scope="session", name="first_divergence")
def first_divergence_fixture():
    return first_divergence
