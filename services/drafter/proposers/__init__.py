"""Draft proposers behind one tiny interface; `PROPOSERS` maps method name → class."""
from specd.drafter.proposers import ngram  # noqa: F401  (registers "ngram")
from specd.drafter.proposers.base import PROPOSERS, Proposal, ProposeRequest

__all__ = ["PROPOSERS", "Proposal", "ProposeRequest"]
