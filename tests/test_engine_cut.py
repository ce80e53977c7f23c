"""`workers.engines.protocol.cut_until_answered`: how a pause with abort waits for every request of its engine to come back,
asking the server to cut again while one is unanswered (the vLLM and SGLang engines use it; their tiers test it on
real servers, this tests its loop without one)."""

from __future__ import annotations

import threading

import pytest

from rolledger.workers.engines.protocol import EngineError, cut_until_answered


def test_it_cuts_again_until_every_request_has_answered() -> None:
    cond = threading.Condition()
    in_flight = [2]
    cuts: list[int] = []

    def cut_again() -> None:  # the server, asked again, cuts one held request, which answers
        cuts.append(in_flight[0])
        with cond:
            in_flight[0] -= 1
            cond.notify_all()

    cut_until_answered(cond, lambda: in_flight[0], cut_again, poll_s=0.001, timeout_s=30, what="the server")
    assert in_flight[0] == 0
    assert cuts == [2, 1]  # one round per request still held, none after the last answered


def test_with_nothing_in_flight_it_returns_without_asking_the_server() -> None:
    asked: list[None] = []
    cut_until_answered(
        threading.Condition(), lambda: 0, lambda: asked.append(None), poll_s=30, timeout_s=30, what="the server"
    )
    assert asked == []


def test_an_answer_arriving_while_it_waits_ends_the_wait_without_another_cut() -> None:
    cond = threading.Condition()
    in_flight = [1]
    asked: list[None] = []

    def answer() -> None:
        with cond:
            in_flight[0] = 0
            cond.notify_all()

    with cond:  # the answer is sent from another thread once the wait has begun (the wait releases the lock)
        threading.Thread(target=answer, daemon=True).start()
        # poll_s is long: only the notification can end the first wait before it
        cut_until_answered(cond, lambda: in_flight[0], lambda: asked.append(None), poll_s=60, timeout_s=120, what="x")
    assert asked == [] and in_flight[0] == 0


def test_past_its_deadline_it_names_what_it_paused_and_how_many_are_unanswered() -> None:
    with pytest.raises(EngineError, match=r"^1 request\(s\) still unanswered 0 s after pausing the server of rank 3$"):
        cut_until_answered(
            threading.Condition(), lambda: 1, lambda: None, poll_s=0.001, timeout_s=0.02, what="the server of rank 3"
        )
