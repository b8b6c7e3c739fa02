"""Speculation: the speculator (speculator.py: drafts before a step's forward, counters after; the
in-process index drafters' offers, offers.py; a proposer's answer checked, validation.py), the
controller that picks k and the drafter per sequence from its online cost model (controller.py: the
plan; record.py: what happened, which the plan reads; pricing.py: a plan's prices of drafts;
exploration.py), what it measures (acceptance.py, costs.py, ledger.py), and the proposer contract
that proposers implement (proposal.py).

May import the core step's types (sequence.py, scheduler.py's Drafts and ScheduledSeq, the
per-request counters of spec_stats.py), never the model room (drafts are tokens; hidden states
reach a drafter as a sequence's FeatureRows) nor the loop (llm_engine.py), which imports this room.
"""
