"""The engine contract (tests/engine_contract.py) run against the vLLM engine on a real vLLM CPU server (rank 0 of
the session's cluster). Afterwards rank 0 serves the start-up weights again, at a later version, so the other tier
tests (which compare the two ranks) find both serving the same weights."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_contract import ContractSubject, EngineContract

from .conftest import VllmCluster

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def subject(vllm_cluster: VllmCluster) -> Iterator[ContractSubject]:
    c = vllm_cluster
    engine = c.engines[0]
    subject = ContractSubject(
        engine, c.base_state, lambda seed: c.other_state(seed=500 + seed), c.stage, versions=c._versions
    )
    yield subject
    subject.commit(c.base_state())


class TestVllmEngine(EngineContract):
    """Every contract test, on a real vLLM server."""
