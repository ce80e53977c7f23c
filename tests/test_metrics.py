"""Prometheus metrics follow the log: version, queued bytes, admission per reason, remaining tokens, lag histogram."""

from __future__ import annotations

from logbuilder import LogBuilder
from prometheus_client import generate_latest

from rolledger.schemas.statuses import AdmissionReason
from rolledger.workers.operator.metrics import RunMetrics
from rolledger.workflows.reducer import replay


def test_metrics_reflect_the_state_and_the_events() -> None:
    b = LogBuilder(group_size=2).start_run()
    b.group()
    done = b.last_group
    b.consume([done])
    b.update(1)
    b.admit(n=2)
    b.pause(AdmissionReason.BYTES)
    events = b.build()
    m = RunMetrics()
    m.observe(replay(events), events)
    text = generate_latest(m.registry).decode()
    assert "rolledger_policy_version 1.0" in text
    assert 'rolledger_admission_paused{reason="bytes"} 1.0' in text
    assert 'rolledger_admission_paused{reason="update"} 0.0' in text
    assert f'rolledger_group_remaining_tokens{{group="{b.last_group}"}}' in text
    assert f'group="{done}"' not in text  # finished groups are not reported
    assert "rolledger_consumed_lag_versions_count 1.0" in text
    assert 'rolledger_updates_total{outcome="published"} 1.0' in text
