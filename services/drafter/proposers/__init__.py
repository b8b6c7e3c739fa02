"""Draft proposers behind one tiny interface; `PROPOSERS` maps method name → class."""
from specd.drafter.proposers import ngram, suffix  # noqa: F401  (register "ngram", "suffix")
from specd.drafter.proposers.base import PROPOSERS, Proposal, ProposeRequest

__all__ = ["PROPOSERS", "Proposal", "ProposeRequest"]
