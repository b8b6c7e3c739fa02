"""Misbehaving drafters, as real gRPC servers on loopback, for the pool's robustness tests.

They speak the real protocol (Info with the target's vocabulary, the bidi Propose stream)
but answer with garbage, or never answer.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from specd.v1 import drafter_pb2, drafter_pb2_grpc

GARBAGE_MODES = ("out_of_vocab", "negative", "too_many", "wrong_seq_ids", "bad_q", "q_length", "random_ids")


class FaultyDrafter(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, mode: str, vocab_size: int, vocab_hash: str):
        self.mode, self.vocab_size, self.vocab_hash = mode, vocab_size, vocab_hash
        self.batches = 0
        self.stop = threading.Event()

    def Info(self, request, context):
        return drafter_pb2.DrafterInfoResponse(name=self.mode, method="ngram", vocab_size=self.vocab_size,
                                               vocab_hash=self.vocab_hash, max_k=8)

    def Release(self, request, context):
        return drafter_pb2.ReleaseResponse()

    def Propose(self, request_iterator, context):
        for batch in request_iterator:
            self.batches += 1
            if self.mode == "hang" and batch.entries:
                self.stop.wait(3600)  # never answers a real batch (answers the empty warm-up)
                return
            yield self._answer(batch)

    def _answer(self, batch):
        out = drafter_pb2.ProposalBatch(batch_id=batch.batch_id)
        for i, e in enumerate(batch.entries):
            k, v = e.k, self.vocab_size
            tokens = {"out_of_vocab": [v + 7] * k, "negative": [-3] * k, "too_many": [5] * (k + 20),
                      "wrong_seq_ids": [5] * k, "bad_q": [5] * k, "q_length": [5] * k,
                      "random_ids": [(e.seq_id * 31 + j * 17 + self.batches) % v for j in range(k)]}[self.mode]
            seq_id = e.seq_id + 1000 if self.mode == "wrong_seq_ids" else e.seq_id
            p = out.proposals.add(seq_id=seq_id, token_ids=tokens)
            if self.mode == "bad_q":  # not a distribution, and the draft is not in its support
                for _ in tokens:
                    p.q.add(ids=[1, 2], probs=[0.9, 0.9])
            if self.mode == "q_length":  # ids and probs of different lengths
                for _ in tokens:
                    p.q.add(ids=[5, 6], probs=[1.0])
        return out


def start_faulty(mode: str, vocab_size: int, vocab_hash: str):
    """(server, servicer, address); stop with server.stop(0) after servicer.stop.set()."""
    servicer = FaultyDrafter(mode, vocab_size, vocab_hash)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    time.sleep(0.05)
    return server, servicer, f"127.0.0.1:{port}"
