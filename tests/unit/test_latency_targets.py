"""Latency targets: the model's defaults from the app config, the request's headers, and their validation."""

from __future__ import annotations

import pytest

from serve_app.config import AppArgs, ingress_config
from serve_app.errors import ApiError
from serve_app.latency_targets import (
    MAX_TARGET_S,
    TOTAL_HEADER,
    TPOT_HEADER,
    TTFT_HEADER,
    parse_target,
    request_targets,
)


def test_without_headers_the_model_defaults_apply():
    assert request_targets({}, None, None) == (None, None, None)
    assert request_targets({}, 0.5, 30.0, 0.08) == (0.5, 30.0, 0.08)


def test_headers_override_the_defaults_one_by_one():
    assert request_targets({TTFT_HEADER: "0.25"}, 0.5, 30.0) == (0.25, 30.0, None)
    assert request_targets({TOTAL_HEADER: " 120 "}, 0.5, 30.0) == (0.5, 120.0, None)  # looser: the client's call
    assert request_targets({TTFT_HEADER: "1e-1", TOTAL_HEADER: "2"}, None, None) == (0.1, 2.0, None)
    assert request_targets({TPOT_HEADER: "0.05"}, None, None, 0.2) == (None, None, 0.05)


@pytest.mark.parametrize("value", ["", "fast", "0", "-1", "nan", "inf", "-inf", "1,5", str(MAX_TARGET_S * 2),
                                   "1" * 40, "0x10"])
def test_a_malformed_target_is_an_invalid_request(value):
    with pytest.raises(ApiError) as e:
        request_targets({TTFT_HEADER: value}, None, None)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert TTFT_HEADER in e.value.message


def test_the_largest_target_is_accepted():
    assert parse_target(TOTAL_HEADER, str(MAX_TARGET_S)) == MAX_TARGET_S


def test_model_defaults_come_from_the_app_config():
    args = AppArgs.model_validate({"models": [
        {"id": "fast", "demo_preset": "small", "ttft_target_s": 0.5, "total_target_s": 20},
        {"id": "free", "demo_preset": "small"}], "policy": {"num_warm_short_actors": 1}})
    fast, free = ingress_config(args).models
    assert (fast.ttft_target_s, fast.total_target_s) == (0.5, 20.0)
    assert (free.ttft_target_s, free.total_target_s) == (None, None)
    for bad in (0, -1, MAX_TARGET_S + 1):
        with pytest.raises(ValueError):
            AppArgs.model_validate({"models": [{"id": "m", "demo_preset": "small", "ttft_target_s": bad}]})
