"""Report sections more than one ``engine bench`` subcommand builds: where a decode step's
time goes, and the steps up to a request's first token."""

from __future__ import annotations

from engine.bench.engine_runner import (
    ATTENTION,
    LOGITS,
    PREPARE,
    PROCESS,
    SAMPLE,
    SCHEDULE,
    UPDATE,
    DecodeBreakdown,
    StepRecord,
)
from engine.bench.report import ENGINE, Section

_OVERHEAD_PHASES = (
    (SCHEDULE, "scheduling (scheduler.schedule)"),
    (PREPARE, "building inputs and attention metadata"),
    (SAMPLE, "sampling (and draft verification)"),
    (UPDATE, "appending tokens, stop checks (update_from_output)"),
    (PROCESS, "output processing (logprobs, finished requests)"),
)


def overhead_section(title: str, description: str, breakdown: DecodeBreakdown | None, labels: list[str]) -> Section:
    section = Section("decode_overhead", f"engine {title}", description)
    if breakdown is None:
        section.notes.append(
            "No step decoded all the requests at once (is --max-num-seqs below the request count?); nothing measured."
        )
        return section
    b = breakdown
    over = f"the {b.num_steps} steps that decoded all {b.num_seqs} sequences and nothing else"
    section.add(
        "step_ms", "step time", "ms", {ENGINE: b.step_seconds * 1e3}, f"mean engine.step() wall time over {over}."
    )
    section.add(
        "model_ms",
        "model time",
        "ms",
        {ENGINE: b.model_seconds * 1e3},
        "mean forward + logits phase time of the engine's step timings (the model's compute) in those steps.",
    )
    if LOGITS in b.parts:
        section.add(
            "logits_ms",
            "  of which compute_logits (LM head)",
            "ms",
            {ENGINE: b.parts[LOGITS] * 1e3},
            "mean logits phase time: model.compute_logits (inside the model time).",
        )
    if ATTENTION in b.parts:
        section.add(
            "attention_ms",
            "  of which attention layers",
            "ms",
            {ENGINE: b.parts[ATTENTION] * 1e3},
            "mean time in the Attention layers' forward, timed by forward hooks (inside the model time).",
        )
    section.add(
        "overhead_ms",
        "engine overhead",
        "ms",
        {ENGINE: b.overhead_seconds * 1e3},
        "step - model: everything but the model's compute (scheduling, building inputs and attention "
        "metadata, sampling, appending tokens, stop checks).",
    )
    for label, text in _OVERHEAD_PHASES:
        if label in b.parts:
            section.add(
                f"{label}_ms",
                f"  of which {text}",
                "ms",
                {ENGINE: b.parts[label] * 1e3},
                f"mean {label} phase time of the engine's step timings (inside the overhead).",
                ".2f",
            )
    section.add("overhead_share", "overhead share", "%", {ENGINE: b.overhead_share}, "(step - model) / step.")
    section.facts = {"num_steps": b.num_steps, "num_seqs": b.num_seqs, "timed_labels": labels}
    return section


# -------------------------------------------------------------------------
# W3 shared prefix
# -------------------------------------------------------------------------


def until_first_token(steps: list[StepRecord]) -> list[StepRecord]:
    """The steps of a run up to and including the first that sampled a token."""
    for i, step in enumerate(steps):
        if step.num_sampled:
            return steps[: i + 1]
    return list(steps)
