"""Verification of drafts lives with the sampler, in ``engine.runtime.verify``."""

from engine.runtime.verify import accept_greedy, accept_sampled, verify

__all__ = ["accept_greedy", "accept_sampled", "verify"]
