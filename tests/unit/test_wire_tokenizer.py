"""Tokenizer files cross the gRPC hop in chunks (Verifier.GetTokenizer): any size round-trips, no
chunk is near a message limit, and pieces out of order or of two vocabularies are refused."""
from __future__ import annotations

import os

import pytest

from specd.rpc.wire import TOKENIZER_CHUNK_BYTES, tokenizer_chunks, tokenizer_files


def test_files_of_any_size_round_trip_in_bounded_chunks():
    files = {"tokenizer.json": os.urandom(3 * TOKENIZER_CHUNK_BYTES + 17), "tokenizer_config.json": b"{}",
             "chat_template.jinja": b"", "exact.bin": os.urandom(TOKENIZER_CHUNK_BYTES)}
    chunks = list(tokenizer_chunks(files, "abc"))
    assert max(c.ByteSize() for c in chunks) < TOKENIZER_CHUNK_BYTES + 1024
    assert len([c for c in chunks if c.name == "tokenizer.json"]) == 4
    # through the wire format itself
    from specd.v1 import verifier_pb2

    decoded = [verifier_pb2.TokenizerChunk.FromString(c.SerializeToString()) for c in chunks]
    assert tokenizer_files(decoded) == (files, "abc")


def test_interleaved_pieces_and_mixed_vocabularies_are_refused():
    a = list(tokenizer_chunks({"tokenizer.json": b"x" * (TOKENIZER_CHUNK_BYTES + 1)}, "h"))
    b = list(tokenizer_chunks({"tokenizer_config.json": b"{}"}, "h"))
    with pytest.raises(ValueError, match="not consecutive"):
        tokenizer_files([a[0], b[0], a[1]])
    with pytest.raises(ValueError, match="different vocabularies"):
        tokenizer_files([*a, *tokenizer_chunks({"x": b"1"}, "other")])
