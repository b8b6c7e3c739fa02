"""An in-process index drafter (suffix) is asked before every plan, for every decoding sequence
at its cap, with only the tokens committed since it last saw each one; the controller plans knowing
what it offered; greedy output is plain decoding's; a finished sequence leaves the index (its answer
goes to the global cache)."""
from __future__ import annotations

from specd import SamplingParams
from specd.engine.spec.offers import ASK_ANYWAY_EVERY

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_an_index_drafter_is_asked_before_each_plan(model_dirs, get_llm, make_prompts):
    target = model_dirs["llama3"]
    prompts = [p * 3 for p in make_prompts(6, seed=11, max_len=12)]  # repeats: the index has matches
    plain = [o.token_ids for o in get_llm(target).generate(prompts, GREEDY)]
    llm = get_llm(target, fresh=True, speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    speculator = llm.engine.speculator
    proposer, controller = speculator.proposer, speculator.controller
    assert speculator.offers.drafters == {"suffix": proposer}
    events, known = [], {}  # ("propose", requests) and ("plan", seqs, offered) in call order

    def propose(requests, _propose=proposer.propose):
        events.append(("propose", requests))
        for r in requests:  # a delta extends exactly what the index holds: never a resync after the first
            assert r.full_history == (r.seq_id not in known) and known.get(r.seq_id, 0) + len(r.new_tokens) == r.num_tokens
            known[r.seq_id] = r.num_tokens
        return _propose(requests)

    def plan(seqs, base_tokens, drafters=None, pinned=None, offered=None, sources=None, _plan=controller.plan):
        events.append(("plan", seqs, offered))
        return _plan(seqs, base_tokens, drafters, pinned, offered, sources)

    proposer.propose, controller.plan = propose, plan
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    plans = [i for i, e in enumerate(events) if e[0] == "plan"]
    assert len(plans) > 10
    for i in plans:
        _, seqs, offered = events[i]
        wanted = {sid for sid, cap, fixed in seqs if cap > 0}
        if not wanted:
            continue
        kind, requests = events[i - 1]  # the index answered just before this plan, for all of them
        assert kind == "propose" and {r.seq_id for r in requests} == wanted
        assert {r.seq_id: r.k for r in requests} == {sid: cap for sid, cap, _ in seqs if cap > 0}
        assert set(offered) <= wanted and all(set(by) == {"suffix"} for by in offered.values())
    assert sum(o.spec["accepted_tokens"] for o in outs) > 0  # drafts offered and taken
    assert proposer.histories.tokens == {} and proposer.requests == {}  # every sequence released
    assert len(proposer.cached) == len(prompts)  # their answers in the global cache


def test_the_verify_cost_model_learns_from_decode_steps_only(model_dirs, get_llm, make_prompts):
    """Prefill chunks cost far less per token than decode and verify rows: fitted into the verify
    cost's line they priced a draft row at batch 32 at a fraction of its cost."""
    target = model_dirs["llama3"]
    prompts = [p * 4 for p in make_prompts(4, seed=3, lengths=[10, 11, 12, 12])]  # 40-48 tokens each
    llm = get_llm(target, fresh=True, speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    controller = llm.engine.speculator.controller
    seen = []

    def observe_verify(tokens, seconds, _observe=controller.observe_verify):
        seen.append(tokens)
        return _observe(tokens, seconds)

    controller.observe_verify = observe_verify
    llm.generate(prompts, GREEDY)
    assert seen and max(seen) <= len(prompts) * (1 + 4)  # decode rows and drafts, never a prompt's 40+


def test_the_index_is_not_asked_where_none_of_its_drafts_could_pay(model_dirs, get_llm, make_prompts):
    """Where the controller finds that no draft of the index could pay at this batch size
    (offers_may_pay: a CPU at batch 32), the sequences it chooses for are asked only every
    ASK_ANYWAY_EVERY-th step (so what the index offers stays measured); a request that set its own
    k is asked every step, and greedy output stays plain decoding's."""
    target = model_dirs["llama3"]
    prompts = [p * 3 for p in make_prompts(2, seed=12, max_len=12)]
    plain = [o.token_ids for o in get_llm(target).generate(prompts, GREEDY)]
    llm = get_llm(target, fresh=True, speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    speculator = llm.engine.speculator
    proposer, controller = speculator.proposer, speculator.controller
    asked, gate = [], []

    def propose(requests, _propose=proposer.propose):
        asked.append({r.seq_id for r in requests})
        return _propose(requests)

    def offers_may_pay(*args):
        gate.append(args[1:3])  # (sequences, base tokens) of the step
        return False, frozenset()

    proposer.propose, controller.offers_may_pay = propose, offers_may_pay
    # Every step plans (no reuse of a plain plan, which asks no index at all: tests/unit/test_plan_reuse.py).
    controller.planned = lambda seconds, base_tokens, **_: None
    own_k = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, num_speculative_tokens=3)
    outs = llm.generate(prompts, [GREEDY, own_k])
    assert [o.token_ids for o in outs] == plain
    assert len(gate) > ASK_ANYWAY_EVERY and all(n in (1, 2) for n, _ in gate)
    counts = {}  # steps each sequence was asked in
    for ids in asked:
        for sid in ids:
            counts[sid] = counts.get(sid, 0) + 1
    rarely, always = sorted(counts.values())  # the request with its own k: asked every step it decoded
    assert rarely == len(gate) // ASK_ANYWAY_EVERY and always > rarely, counts
    assert outs[1].spec["drafts"] > 0
