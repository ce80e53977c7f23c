"""Invariant 9, the trainer's lineage: every staged version records the digest of the weights it was trained from
(manifest.parent_digest, UpdateStaged.parent_weights_digest); the audit fails a version trained from weights that
are neither the trainer's last staged version's nor the published ones, and the trainer refuses to train on such
weights in the first place. The fault this closes: a trainer restarted on the initial checkpoint after v2 was
published staged what it trained from there as v3, the ranks served it, and the audit said OK."""

from __future__ import annotations

import pytest
import torch
from logbuilder import LogBuilder, weights_digest_for

from rolledger.schemas.weights import TensorEntry, WeightManifest
from rolledger.workers.policy.policy_model import policy_state
from rolledger.workers.weights.tensors import state_digest
from rolledger.workflows.audit import audit
from rolledger.workflows.reducer import replay
from rolledger.workflows.trainer import lineage

W = weights_digest_for


def _violations(b: LogBuilder) -> list[str]:
    return [v.message for v in audit(b.build()).violations if v.invariant == 9]


def test_a_version_trained_from_the_initial_weights_after_a_publish_fails_the_audit() -> None:
    b = LogBuilder().start_run()
    b.update(1, parent=W(0)).update(2, parent=W(1))
    b.update(3, parent=W(0))  # the restarted trainer's v0 weights, trained into "v3"
    found = _violations(b)
    assert len(found) == 1 and "v3 was trained from weights" in found[0] and W(0) in found[0], found


def test_the_lineages_a_real_run_takes_pass() -> None:
    b = LogBuilder().start_run()
    b.update(1, parent=W(0))
    b.update(2, fail_rank=0, parent=W(1))  # aborted: the trainer trains on from its own v2
    b.update(3, parent=W(2))
    b.update(4, fail_rank=0, parent=W(3))  # aborted, and the trainer's copy of v4 was lost: it resumes from v3
    b.update(5, parent=W(3))
    report = audit(b.build())
    assert _violations(b) == [] and report.checked[9] == 5


def test_logs_from_before_lineage_was_recorded_are_not_checked() -> None:
    b = LogBuilder().start_run()
    b.update(1).update(2)
    report = audit(b.build())
    assert report.ok and report.checked[9] == 0


def test_the_trainers_allowed_parents_are_its_last_staged_version_and_the_published_one() -> None:
    model = torch.nn.Linear(3, 2)
    w0 = state_digest(policy_state(model))
    b = LogBuilder().start_run()
    b.update(1, weights=W(1), parent=W(0)).update(2, fail_rank=0, weights=W(2), parent=W(1))
    state = replay(b.build())
    assert lineage(state) == {W(1), W(2)}
    assert w0 not in lineage(state)  # a fresh v0 model: the trainer refuses (trainer_api.LineageError)


def test_the_parent_is_part_of_the_manifests_identity_only_when_recorded() -> None:
    entry = TensorEntry(name="w", shape=(2,), dtype="float32", nbytes=8, checksum="0" * 32)
    plain = WeightManifest(version=2, base_version=1, tensors=(entry,), total_bytes=8)
    with_parent = plain.model_copy(update={"parent_digest": W(1)})
    other_parent = plain.model_copy(update={"parent_digest": W(0)})
    assert len({plain.digest, with_parent.digest, other_parent.digest}) == 3
    assert plain.digest == WeightManifest.model_validate_json(plain.model_dump_json()).digest


@pytest.mark.parametrize("restored", [False, True])
def test_the_trainer_refuses_weights_outside_its_lineage(restored: bool) -> None:
    from rolledger.workers.roles.trainer_api import LineageError, check_lineage

    model = torch.nn.Linear(3, 2)
    staged = {k: v.clone() + 1.0 for k, v in policy_state(model).items()}
    b = LogBuilder().start_run()
    b.update(1, weights=state_digest(staged), parent=W(0))
    state = replay(b.build())
    if restored:
        with torch.no_grad():
            for k, p in policy_state(model).items():
                p.copy_(staged[k])
        assert check_lineage(policy_state(model), state) == state_digest(staged)
    else:
        with pytest.raises(LineageError, match="refusing to train v2"):
            check_lineage(policy_state(model), state)
