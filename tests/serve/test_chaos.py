"""Chaos: 100 concurrent clients against a real `agent-r1 serve`, a fifth of them malformed, oversized
or disconnecting early (benchmarks/chaos_serve.py). The good ones are all served, the bad ones get the
4xx their kind calls for, and the server comes out whole."""

from __future__ import annotations

import pytest

from benchmarks.chaos_serve import BAD_KINDS, GOOD_KINDS, plan, run


@pytest.fixture(scope="module")
def chaos(tiny_model_dir):
    """One storm for every test here: 100 clients, 20 bad ones, 8 tokens per good completion, a 1 MiB
    body limit (so the many-MB bodies are 8x over it)."""
    return run(tiny_model_dir, clients=100, bad_fraction=0.2, seed=0, max_tokens=8, after=20, max_request_mb=1.0)


def test_the_plan_covers_every_bad_kind_and_keeps_the_good_share():
    kinds = plan(100, 0.2, seed=0)
    assert len(kinds) == 100
    assert sum(k in BAD_KINDS for k in kinds) == 20
    assert set(BAD_KINDS) <= set(kinds) and set(GOOD_KINDS) <= set(kinds)
    assert kinds != plan(100, 0.2, seed=1)  # the seed shuffles the order


def test_every_good_client_gets_a_valid_completion(chaos):
    storm = chaos["storm"]
    assert storm["good"] == 80
    assert storm["good_ok"] == 80, storm["failures"]
    assert storm["5xx"] == 0 and storm["connection_errors"] == 0
    assert storm["good_p95_s"] < 60


def test_every_bad_client_gets_the_4xx_of_its_kind(chaos):
    by_kind = chaos["storm"]["status_by_kind"]
    for kind, status in BAD_KINDS.items():
        if status is not None:
            assert by_kind[kind] == {str(status): sum(by_kind[kind].values())}, (kind, chaos["storm"]["failures"])
    assert chaos["storm"]["failures"] == []


def test_disconnects_are_handled_and_nothing_is_left_generating(chaos):
    by_kind = chaos["storm"]["status_by_kind"]
    for kind in ("drop_mid_stream", "drop_mid_completion_stream"):
        assert set(by_kind[kind]) == {"200"}  # the stream had started when the client left
    assert chaos["health"]["generating"] == 0


def test_the_server_stays_up_and_serves_again(chaos):
    assert chaos["alive"] and chaos["server_alive_at_end"]
    assert chaos["health"]["health_status"] == 200 and chaos["health"]["models_status"] == 200
    assert chaos["after"]["good_ok"] == chaos["after"]["good"] == 20
    assert chaos["rss_growth_mb"] < chaos["rss_limit_mb"]
    assert chaos["server_tracebacks"] == 0, chaos.get("server_log_tail")
    assert chaos["problems"] == []
