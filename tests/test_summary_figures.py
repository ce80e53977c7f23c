"""The summary's renamed figures over the committed fixture logs and a built one: the reward pair (one definition),
engine_idle_fraction in every mode and handoff_tax only where there is a handoff (colocated), and the queue check,
whose predicted and measured figures come from disjoint windows (not the identity Little's law is over one window)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rolledger.events.codec import decode
from rolledger.events.envelope import make_event
from rolledger.schemas import events as ev
from rolledger.schemas.statuses import GroupOutcome
from rolledger.workflows.admission import throttle_bound
from rolledger.workflows.figures import reward_edges
from rolledger.workflows.reducer import fold
from rolledger.workflows.state import RunState
from rolledger.workflows.summary import Summary, queue_check, summarize

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from history import load_entries  # tests/fixtures is not a package (as in test_replay_fixtures)


def _fixture(name: str) -> tuple[RunState, list[ev.Event], Summary]:
    _run_id, entries = load_entries(name)
    events = [decode(raw) for _sid, raw in entries]
    state = RunState()
    for e in events:
        state = fold(state, e)
    return state, events, summarize(state, events)


def test_the_summary_reward_pair_is_the_one_definition() -> None:
    state, _events, summary = _fixture("clean")
    assert len(state.trainer.rewards) == 3
    assert (summary.reward_first, summary.reward_last) == reward_edges(state.trainer.rewards)


def test_disaggregated_runs_report_engine_idle_and_no_handoff_tax() -> None:
    _state, _events, summary = _fixture("clean")
    assert summary.handoff_tax is None  # no handoff in disaggregated mode: the idle time is not a tax of one
    assert 0 < summary.engine_idle_fraction < 1
    d = summary.to_dict()
    assert "engine_idle_fraction" in d and d["handoff_tax"] is None and "littles_law" not in d


def test_colocated_handoff_tax_is_the_time_between_each_rank_sleeping_and_resuming() -> None:
    state, events, summary = _fixture("colocated")
    assert state.config is not None and state.config.mode == "colocated"
    handed: dict[int, float] = {}
    slept: dict[int, float] = {}
    for e in events:
        if isinstance(e.payload, ev.EngineSlept):
            slept[e.payload.rank] = e.wall_time
        elif isinstance(e.payload, ev.EngineResumed) and e.payload.rank in slept:
            handed[e.payload.rank] = handed.get(e.payload.rank, 0.0) + e.wall_time - slept.pop(e.payload.rank)
    assert len(handed) == len(state.ranks) == 2 and not slept
    expected = sum(handed.values()) / len(handed) / summary.wall_s
    assert summary.handoff_tax is not None and summary.handoff_tax == pytest.approx(expected)
    assert 0 < summary.handoff_tax <= summary.engine_idle_fraction  # a rank handed to the trainer is not generating


def _at(t: float, payload: ev.Payload) -> ev.Event:
    return make_event(payload, run_id="q", producer="test", policy_version=0, wall_time=t)


def _completed(t: float, gid: str) -> ev.Event:
    return _at(t, ev.GroupCompleted(group_id=gid, accepted=(f"{gid}/0",), status=GroupOutcome.COMPLETE, bytes=10))


def _consumed(t: float, *gids: str) -> ev.Event:
    return _at(
        t,
        ev.BatchConsumed(
            step=int(t), group_ids=gids, versions=(0,) * len(gids), lags=(0,) * len(gids), trajectory_ids=()
        ),
    )


def _published(t: float) -> ev.Event:
    return _at(t, ev.PolicyPublished(version=int(t), weights_digest="w", ranks=(0,), fence=1))


def test_queue_check_predicts_the_second_half_from_the_first() -> None:
    """Publishes every 10 s. First half (0, 20]: 2 groups per period, each consumed within it (waits 8 and 7 s):
    no net growth, Little's L = 0.2/s x 7.5 s = 1.5. Second half (20, 40]: 4 groups per period, only 2 consumed: the
    queue grows by 2 per period and averages 3.8. The check says so: the prediction is not the measurement."""
    events = [_published(0.0)]
    events += [_completed(1, "g1"), _completed(2, "g2"), _consumed(9, "g1", "g2"), _published(10)]
    events += [_completed(11, "g3"), _completed(12, "g4"), _consumed(19, "g3", "g4"), _published(20)]
    events += [_completed(21 + i, f"g{5 + i}") for i in range(4)] + [_consumed(29, "g5", "g6"), _published(30)]
    events += [_completed(31 + i, f"g{9 + i}") for i in range(4)] + [_consumed(39, "g7", "g8"), _published(40)]
    check = queue_check(events, throttle_cap_groups=16)
    assert check == pytest.approx(
        {
            "fit_window_s": 20.0,
            "check_window_s": 20.0,
            "arrival_rate_groups_s": 0.2,
            "drain_rate_groups_s": 0.2,
            "update_period_s": 10.0,
            "predicted_growth_per_period_groups": 0.0,
            "measured_growth_per_period_groups": 2.0,
            "predicted_mean_queue_groups": 1.5,
            "measured_mean_queue_groups": 3.8,
            "measured_max_growth_in_period_groups": 4.0,
            "measured_max_queue_groups": 6.0,
            "throttle_cap_groups": 16.0,
        }
    )


def test_queue_check_without_enough_publishes_names_no_windows() -> None:
    events = [_published(0.0), _completed(1, "g1"), _consumed(2, "g1"), _published(3)]
    check = queue_check(events)
    assert check["predicted_mean_queue_groups"] is None and check["measured_mean_queue_groups"] is None
    assert check["measured_max_queue_groups"] == 1.0 and check["throttle_cap_groups"] is None


def test_queue_check_on_the_fixture_stays_under_the_throttle_cap() -> None:
    state, _events, summary = _fixture("clean")
    check = summary.queue_check
    assert state.config is not None
    assert check["throttle_cap_groups"] == throttle_bound(state.config)
    assert check["measured_max_queue_groups"] is not None and check["throttle_cap_groups"] is not None
    assert check["measured_max_queue_groups"] <= check["throttle_cap_groups"]
    assert all(k.startswith(("predicted_", "measured_")) for k in check if "queue" in k or "growth" in k)
