"""Engine configuration: one pydantic model; derived values are filled in one place."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DType = Literal["auto", "float32", "bfloat16", "float16"]


class EngineConfig(BaseModel):
    """Settings of the verifier engine (also used offline by specd.LLM)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    dtype: DType = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1, le=1024)
    # KV budget: num_kv_blocks wins when set; else kv_cache_gb; else enough for
    # max_num_seqs full-length sequences, capped by a default budget.
    kv_cache_gb: float | None = Field(default=None, gt=0)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    enable_chunked_prefill: bool = True
    seed: int = 0


def format_validation_error(err: Exception) -> str:
    """One line from a pydantic ValidationError (field: reason; ...)."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        parts = []
        for e in errors():
            loc = ".".join(str(x) for x in e.get("loc", ())) or "config"
            parts.append(f"{loc}: {e.get('msg')}")
        return "; ".join(parts)
    return str(err)
