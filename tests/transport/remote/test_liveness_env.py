"""peer_liveness_timeout_s becomes UCX's TCP keepalive and user timeout."""

from __future__ import annotations

from kvd.transport.remote.nixl import ucx_liveness_env


def test_default_three_seconds_sets_keepalive_and_user_timeout() -> None:
    env: dict[str, str] = {}
    ucx_liveness_env(3.0, env)
    assert env == {"UCX_TCP_KEEPIDLE": "1s", "UCX_TCP_KEEPINTVL": "1s", "UCX_TCP_KEEPCNT": "2",
                   "UCX_TCP_USER_TIMEOUT": "3s"}


def test_an_operators_ucx_settings_win() -> None:
    env = {"UCX_TCP_KEEPIDLE": "30s"}
    set_now = ucx_liveness_env(9.0, env)
    assert env["UCX_TCP_KEEPIDLE"] == "30s" and "UCX_TCP_KEEPIDLE" not in set_now
    assert env["UCX_TCP_KEEPINTVL"] == "3s" and env["UCX_TCP_USER_TIMEOUT"] == "9s"


def test_sub_second_timeouts_round_up_to_whole_seconds() -> None:
    env: dict[str, str] = {}
    ucx_liveness_env(0.5, env)
    assert env["UCX_TCP_KEEPIDLE"] == "1s"  # Linux keepalive counts whole seconds
