"""Draft proposers behind one tiny interface; `PROPOSERS` maps method name → class."""
from specd.proposers import ngram, suffix  # noqa: F401  (register "ngram", "suffix")
from specd.proposers.base import PROPOSERS, Proposal, ProposeRequest

__all__ = ["PROPOSERS", "Proposal", "ProposeRequest"]
