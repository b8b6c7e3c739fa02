"""A drafter service answers an index proposer (suffix, n-gram: answers_inline) on its event loop,
not through its worker thread: the hand-offs cost more than the answer. Shown with the worker's
one thread held busy: the suffix drafter still answers, with the drafts its proposer gives."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from specd.drafter.server import DrafterService
from specd.proposers.base import ProposeRequest
from specd.proposers.suffix import SuffixProposer
from specd.v1 import drafter_pb2 as dpb

HISTORY = [5, 6, 7, 8, 9] * 6


async def one_batch(service: DrafterService, batch: dpb.ProposeBatch) -> dpb.ProposalBatch:
    async def batches():
        yield batch

    replies = service.Propose(batches(), None)
    return await asyncio.wait_for(replies.__anext__(), timeout=10)


def test_an_index_proposer_answers_while_the_worker_thread_is_busy():
    worker, held = ThreadPoolExecutor(max_workers=1), threading.Event()
    worker.submit(held.wait)  # the worker's only thread, busy until the test ends
    try:
        service = DrafterService(SuffixProposer(num_speculative_tokens=4), dpb.DrafterInfoResponse(
            name="suffix", method="suffix", max_k=4), worker=worker)
        entry = dpb.ProposeEntry(seq_id=1, new_tokens=HISTORY, num_tokens=len(HISTORY), k=4, full_history=True)
        reply = asyncio.run(one_batch(service, dpb.ProposeBatch(client_id="c", batch_id=1, entries=[entry])))
        (expected,) = SuffixProposer(num_speculative_tokens=4).propose(
            [ProposeRequest(1, HISTORY, len(HISTORY), 4, full_history=True)])
        assert reply.batch_id == 1 and list(reply.proposals[0].token_ids) == expected.token_ids == [5, 6, 7, 8]
    finally:
        held.set()
        worker.shutdown()
