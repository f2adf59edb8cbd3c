"""The built-in proposers through the conformance kit."""

from engine.testing.kit import SpecProposerTests


class TestNgramKit(SpecProposerTests):
    plugin = ""  # built into the engine: no plugin to load
    proposer_name = "ngram"


class TestDraftModelKit(SpecProposerTests):
    plugin = ""
    proposer_name = "draft"

    def config(self, target):
        return {"model": str(target), "kv_cache_memory": 0.02}  # the target drafting for itself
