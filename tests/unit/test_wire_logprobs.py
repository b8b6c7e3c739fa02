"""Logprob settings over the wire: SamplingParams -> GenerateRequest.params -> SamplingParams."""
from __future__ import annotations

import pytest

from specd import SamplingParams
from specd.v1 import verifier_pb2
from specd.rpc.wire import params_from_proto, params_to_proto


@pytest.mark.parametrize("logprobs,want,top", [(None, False, 0), (False, False, 0), (True, True, 0), (0, True, 0),
                                               (1, True, 1), (20, True, 20)])
def test_round_trip(logprobs, want, top):
    p = SamplingParams(logprobs=logprobs)
    assert (p.want_logprobs, p.num_top_logprobs) == (want, top)
    msg = params_to_proto(p)
    assert (msg.logprobs, msg.top_logprobs) == (want, top)
    back = params_from_proto(msg)
    assert (back.want_logprobs, back.num_top_logprobs) == (want, top)


@pytest.mark.parametrize("logprobs,top,message", [(False, 3, "needs logprobs"), (True, 21, "between 0 and 20")])
def test_bad_values_from_the_wire_raise(logprobs, top, message):
    msg = verifier_pb2.SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, logprobs=logprobs, top_logprobs=top)
    with pytest.raises(ValueError, match=message):
        params_from_proto(msg)
