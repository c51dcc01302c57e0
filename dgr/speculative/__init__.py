"""Speculative decoding's pure parts (issue 42): n-gram drafts, acceptance, adaptive k, step bookkeeping."""

from dgr.speculative.accept import Verdict
from dgr.speculative.adapt import Acceptance, RouteCost, Shadow, choose_k
from dgr.speculative.ngram import NgramDrafter
from dgr.speculative.step import KvWindow, Settled, SpecCounters, SpecStep

__all__ = [
    "Verdict",
    "Acceptance",
    "RouteCost",
    "Shadow",
    "choose_k",
    "NgramDrafter",
    "KvWindow",
    "Settled",
    "SpecCounters",
    "SpecStep",
]
