"""Speculative decoding: proposers draft tokens, the target verifies them in one
forward pass (:mod:`.verify`), and :mod:`.budget` decides how many drafts each
request gets. Proposers that ship with the engine are registered without a plugin."""

BUILTIN_SPEC_PROPOSERS = {
    "ngram": "engine.spec_decode.ngram:NgramProposer",
    "draft": "engine.spec_decode.draft:DraftModelProposer",
    "mtp": "engine.spec_decode.mtp:MtpProposer",
}
