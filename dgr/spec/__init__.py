"""Speculative decoding's pure parts (issue 42): n-gram drafts, acceptance, adaptive k, step bookkeeping."""

from dgr.spec.accept import Verdict
from dgr.spec.adapt import Acceptance, RouteCost, Shadow, choose_k
from dgr.spec.ngram import NgramDrafter
from dgr.spec.step import KvWindow, Settled, SpecCounters, SpecStep

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
