"""The speculative decoder's acceptance on a vLLM server, read from its Prometheus counters: how many draft tokens
were proposed (`vllm:spec_decode_num_draft_tokens_total`) and how many the target model accepted
(`vllm:spec_decode_num_accepted_tokens_total`), summed over the server's engines. The acceptance over a window is
the share accepted between two readings; a window in which nothing was drafted has none (None).

A rank reads the counters at its commit (the window before: what it served since its previous probe) and after its
health probe (the window on the new weights), and reports both in HealthPassed; workflows/health.py judges the drop.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTED = "vllm:spec_decode_num_draft_tokens"


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """Cumulative draft tokens proposed and accepted, as one reading of the server's /metrics."""

    drafted: float
    accepted: float


def read_spec_counters(metrics_text: str) -> SpecCounters | None:
    """The counters in a /metrics page (Prometheus text format); None when the server exports neither (no draft)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:  # by the sample's name: the family's depends on how its TYPE line is spelled
            name = s.name.removesuffix("_total")
            if name in (ACCEPTED, DRAFTED) and s.name.endswith("_total"):
                totals[name] = totals.get(name, 0.0) + s.value
    if not totals:
        return None
    return SpecCounters(drafted=totals.get(DRAFTED, 0.0), accepted=totals.get(ACCEPTED, 0.0))


def acceptance(since: SpecCounters | None, now: SpecCounters | None) -> float | None:
    """The share of draft tokens accepted between two readings (from the server's start when `since` is None);
    None when either reading is missing or nothing was drafted in between. A counter that went backwards (the server
    restarted) counts from zero."""
    if now is None:
        return None
    base = since if since is not None and since.drafted <= now.drafted else SpecCounters(0.0, 0.0)
    drafted = now.drafted - base.drafted
    if drafted <= 0:
        return None
    return min(1.0, max(0.0, (now.accepted - base.accepted) / drafted))
