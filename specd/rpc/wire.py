"""Conversions between specd's Python types and the gRPC messages (one place, both sides)."""
from __future__ import annotations

import json

from specd.engine.spec.proposal import Proposal, ProposeRequest
from specd.sampling import SamplingParams
from specd.structured import StructuredOutput
from specd.v1 import drafter_pb2, verifier_pb2


def params_to_proto(p: SamplingParams, drafter: str = "") -> verifier_pb2.SamplingParams:
    msg = verifier_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        stop_token_ids=p.stop_token_ids, stop=p.stop, ignore_eos=p.ignore_eos, logprobs=p.want_logprobs,
        top_logprobs=p.num_top_logprobs, drafter=drafter,
        structured_outputs=json.dumps(p.structured_outputs.to_dict()) if p.structured_outputs else "",
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, min_tokens=p.min_tokens, n=p.n)
    if p.seed is not None:
        msg.seed = p.seed
    if p.num_speculative_tokens is not None:
        msg.num_speculative_tokens = p.num_speculative_tokens
    if not p.cache_output:
        msg.cache_output = False
    return msg


def params_from_proto(msg: verifier_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (naming the field) for values SamplingParams rejects.

    An unset top_p (proto3's 0, never a valid top_p) means the default, 1.0 (off).
    """
    if msg.top_logprobs and not msg.logprobs:
        raise ValueError(f"top_logprobs ({msg.top_logprobs}) needs logprobs to be set")
    structured = None
    if msg.structured_outputs:
        try:
            structured = StructuredOutput.from_dict(json.loads(msg.structured_outputs))
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs is not valid JSON: {e}") from None
    return SamplingParams(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
        min_p=msg.min_p, seed=msg.seed if msg.HasField("seed") else None, stop_token_ids=list(msg.stop_token_ids),
        stop=list(msg.stop),
        ignore_eos=msg.ignore_eos, logprobs=(msg.top_logprobs or True) if msg.logprobs else None,
        num_speculative_tokens=msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else None,
        structured_outputs=structured, cache_output=msg.cache_output if msg.HasField("cache_output") else True,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0, logit_bias=dict(msg.logit_bias), min_tokens=msg.min_tokens,
        n=msg.n or 1)


def spec_to_dict(spec: verifier_pb2.SpecCounters) -> dict:
    """A request's speculation, as `usage.speculative` reports it (vLLM's per-request spec metrics:
    acceptance per position and mean acceptance length, and which drafters the controller used)."""
    return {"drafts": spec.drafts, "draft_tokens": spec.draft_tokens, "accepted_tokens": spec.accepted_tokens,
            "accepted_per_pos": list(spec.accepted_per_pos),
            "mean_acceptance_length": 1.0 + spec.accepted_tokens / spec.drafts if spec.drafts else 1.0,
            "drafters": dict(spec.drafts_by_drafter)}


# Hidden states travel as raw little-endian bytes: bf16 has no numpy dtype, so it goes as its
# 16-bit pattern. Only these dtypes are accepted from the wire.
FEATURE_DTYPES = ("bfloat16", "float16", "float32")
# Rows per message, by bytes: a long prompt's features are sent in several entries under this.
MAX_FEATURE_BYTES = 8 << 20


def tensor_to_proto(t, msg) -> None:
    """Fill a drafter_pb2.Tensor from a 2-D CPU or GPU tensor."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in FEATURE_DTYPES:
        t, name = t.float(), "float32"
    raw = t.detach().contiguous().cpu()
    raw = raw.view(torch.int16) if name == "bfloat16" else raw
    msg.data = raw.numpy().tobytes()
    msg.shape[:] = list(t.shape)
    msg.dtype = name


def tensor_from_proto(msg):
    """The tensor a drafter_pb2.Tensor holds; ValueError when its dtype, shape and size disagree."""
    import torch

    if msg.dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype {msg.dtype!r} is not one of {', '.join(FEATURE_DTYPES)}")
    dtype = getattr(torch, msg.dtype)
    shape = list(msg.shape)
    if len(shape) != 2:
        raise ValueError(f"features must be 2-D [rows, width], got shape {shape}")
    if len(msg.data) != shape[0] * shape[1] * dtype.itemsize:
        raise ValueError(f"features of shape {shape} in {msg.dtype} need {shape[0] * shape[1] * dtype.itemsize} "
                         f"bytes, got {len(msg.data)}")
    if not msg.data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).view(shape)


TOKENIZER_CHUNK_BYTES = 1 << 20  # far below any gRPC message limit, so no vocabulary size meets one


def tokenizer_chunks(files: dict[str, bytes], vocab_hash: str):
    """Tokenizer files (name -> contents) as Verifier.GetTokenizer streams them: each file's bytes
    in order, in pieces of at most TOKENIZER_CHUNK_BYTES (an empty file is one empty piece)."""
    for name, data in files.items():
        for start in range(0, max(len(data), 1), TOKENIZER_CHUNK_BYTES):
            yield verifier_pb2.TokenizerChunk(name=name, data=data[start:start + TOKENIZER_CHUNK_BYTES],
                                              vocab_hash=vocab_hash)


def tokenizer_files(chunks) -> tuple[dict[str, bytes], str]:
    """tokenizer_chunks' pieces -> (name -> contents, vocab_hash). ValueError where a file's pieces
    are not consecutive or the chunks disagree on the vocabulary."""
    files: dict[str, bytearray] = {}
    hashes, last = set(), None
    for chunk in chunks:
        if chunk.name != last and chunk.name in files:
            raise ValueError(f"tokenizer file {chunk.name!r} came in pieces that are not consecutive")
        files.setdefault(chunk.name, bytearray()).extend(chunk.data)
        hashes.add(chunk.vocab_hash)
        last = chunk.name
    if len(hashes) > 1:
        raise ValueError("tokenizer chunks name different vocabularies")
    return {name: bytes(data) for name, data in files.items()}, next(iter(hashes), "")


# -- the drafter hop: ProposeRequest -> ProposeEntry (verifier) -> ProposeRequest (drafter), and
# Proposal -> the proto's Proposal (drafter) -> Proposal (verifier)

def propose_entry_to_proto(batch: drafter_pb2.ProposeBatch, r: ProposeRequest, k: int) -> int:
    """r as an entry of batch, asking k drafts; the bytes of target features it carries."""
    entry = batch.entries.add(seq_id=r.seq_id, new_tokens=r.new_tokens, num_tokens=r.num_tokens, k=k,
                              full_history=r.full_history, num_prompt_tokens=r.num_prompt_tokens or 0,
                              temperature=r.temperature, structured_outputs=r.structured_outputs or "",
                              features_from=r.features_from if r.full_history else 0)
    if r.seed is not None:
        entry.seed = r.seed
    if r.full_history and not r.cache_output:
        entry.cache_output = False
    if r.features is None:
        return 0
    tensor_to_proto(r.features, entry.features)
    return len(entry.features.data)


def propose_request_from_proto(e: drafter_pb2.ProposeEntry, seq_id: int, k: int, features=None) -> ProposeRequest:
    """A drafter's view of an entry: seq_id its own key for the sequence, k within its limit,
    features already read and checked (propose_entry_to_proto's inverse for the rest)."""
    return ProposeRequest(seq_id=seq_id, new_tokens=list(e.new_tokens), num_tokens=e.num_tokens, k=k,
                          full_history=e.full_history, temperature=e.temperature,
                          seed=e.seed if e.HasField("seed") else None, num_prompt_tokens=e.num_prompt_tokens or None,
                          features=features, structured_outputs=e.structured_outputs or None,
                          features_from=e.features_from if e.full_history else 0,
                          cache_output=e.cache_output if e.HasField("cache_output") else True)


def proposal_to_proto(out: drafter_pb2.ProposalBatch, seq_id: int, p: Proposal) -> None:
    """p as the proposal for the verifier's sequence seq_id in out."""
    msg = out.proposals.add(seq_id=seq_id, token_ids=p.token_ids, resync=p.resync, history_held=p.history_held,
                            cached=p.cached, parents=p.parents or [])
    for ids, probs in zip(p.q_ids or [], p.q_probs or []):
        msg.q.add(ids=ids, probs=probs)


def proposal_from_proto(p: drafter_pb2.Proposal, drafter: str, use_q: bool) -> Proposal:
    """A drafter's proposal (already checked within bounds); its sparse q only with use_q (a trusted
    drafter's), else None: the drafts are then verified as one-hot."""
    return Proposal(seq_id=p.seq_id, token_ids=list(p.token_ids),
                    q_ids=[list(d.ids) for d in p.q] if use_q else None,
                    q_probs=[list(d.probs) for d in p.q] if use_q else None,
                    parents=list(p.parents) if len(p.parents) else None,
                    resync=p.resync, history_held=p.history_held, drafter=drafter, cached=p.cached)
