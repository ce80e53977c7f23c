"""schemas.wire.encoded_size, the accounting size admission and invariant 6 count, is counted from the positional
encoding plus the field names; it must equal the size of the map form built and packed (`map_form_size`), the
measure every recorded log was audited with, for any trajectory: strings, arrays and span lists across every msgpack
header size, any sampling parameters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rolledger.schemas.config import SamplingParams
from rolledger.schemas.trajectory import Trajectory, VersionSpan
from rolledger.schemas.wire import encoded_size, map_form_size

# lengths on both sides of msgpack's header boundaries: fixstr 31 / str8 255 / str16 65535, fixarray 15 / array16
_TEXT = st.sampled_from([0, 1, 31, 32, 255, 256]).flatmap(lambda n: st.text(min_size=n, max_size=n))
_COUNT = st.sampled_from([0, 1, 15, 16, 63, 64, 300])
_INT = st.integers(0, 2**63 - 1)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    n = draw(_COUNT)
    spans = draw(
        st.lists(
            st.builds(VersionSpan, start=_INT, end=_INT, policy_version=_INT, weights_digest=_TEXT),
            max_size=20,
        )
    )
    sampling = SamplingParams(
        temperature=draw(st.floats(0, 10)),
        top_k=draw(_INT),
        max_tokens=draw(st.integers(1, 2**40)),
        stop_token_ids=tuple(draw(st.lists(st.integers(-(2**40), 2**40), max_size=20))),
        seed=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        logprob_mode=draw(st.sampled_from(["raw", "processed"])),
    )
    return Trajectory(
        trajectory_id=draw(_TEXT),
        group_id=draw(_TEXT),
        prompt_id=draw(_TEXT),
        index=draw(_INT),
        prompt_token_ids=draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70)),
        token_ids=[draw(st.integers(-(2**31), 2**31 - 1))] * n,
        loss_mask=[1] * n,
        positions=list(range(n)),
        logprobs=[draw(st.floats(width=32, allow_nan=False))] * n,
        logprob_mode=draw(st.sampled_from(["raw", "processed"])),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        sampling=sampling,
        policy_version=draw(_INT),
        weights_digest=draw(_TEXT),
        rank=draw(_INT),
        engine=draw(_TEXT),
        cache_generation=draw(_INT),
        graph_generation=draw(_INT),
        spans=tuple(spans),
    )


@settings(max_examples=300, deadline=None)
@given(trajectories())
def test_the_counted_size_is_the_packed_map_forms(t: Trajectory) -> None:
    assert encoded_size(t) == map_form_size(t)


def test_a_long_array_crosses_the_ext32_header() -> None:
    n = 20_000  # 80,001 bytes of int32 ext payload: past ext16's 65,535
    t = Trajectory(
        trajectory_id="g1/0",
        group_id="g1",
        prompt_id="p",
        index=0,
        prompt_token_ids=[1],
        token_ids=[7] * n,
        loss_mask=[1] * n,
        positions=list(range(n)),
        logprobs=[-0.5] * n,
        logprob_mode="raw",
        finish_reason="length",
        sampling=SamplingParams(),
        policy_version=0,
        weights_digest="w",
        rank=0,
        engine="torch",
        cache_generation=0,
        graph_generation=0,
    )
    assert encoded_size(t) == map_form_size(t) > 4 * n
