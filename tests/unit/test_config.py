"""The app builder's args: each YAML section is checked once, at build time, and handed down frozen."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app.config import AppArgs, ingress_config

BASE = {"models": [{"id": "m", "zqs_path": "m.zqs"}], "namespace": "ns"}


@pytest.mark.parametrize("section, fields, naming", [
    ("policy", {"max_batchh": 4}, "policy.max_batchh"),  # a misspelt name, not silently ignored
    ("policy", {"max_batch": "eight"}, "policy.max_batch"),
    ("policy", {"max_batch": 0}, "max_batch must be >= 1"),  # the dataclass's own range check
    ("actor", {"num_cpus": "one"}, "actor.num_cpus"),
    ("actor", {"max_batch": 4}, "actor.max_batch is set from policy.max_batch"),
    ("actor", {"namespace": "x"}, "actor.namespace is set from the top-level namespace"),
    ("actor", {"compute_dtype": "fp8"}, "compute_dtype must be one of auto, model, float32"),
    ("actor", {"packed_kernel": "amx"}, "packed_kernel must be auto or onednn"),
    ("actor", {"kv_dtype": "fp8"}, "kv_dtype must be auto or int8"),
    ("actor", {"kv_dtype": "int8", "is_compiled": True}, "kv_dtype int8 is not served by the compiled step"),
    ("actor", {"compute_threads": 2, "min_compute_threads": 3}, "1 <= min_compute_threads <= compute_threads"),
    ("actor", {"min_compute_threads": 0}, "1 <= min_compute_threads <= compute_threads"),
    ("registry", {"reconcile_interval_s": 0}, "reconcile_interval_s"),
    ("registry", {"namespace": "x"}, "registry.namespace is derived"),
    ("registry", {"spawn_grace": 1}, "registry.spawn_grace"),
    ("telemetry", {"ewma_alpha": 2}, "ewma_alpha"),
    ("rule_scorer", {"decode_s_per_tokens": 0.1}, "rule_scorer.decode_s_per_tokens"),
    ("rule_scorer", {"step_threads": 2}, "rule_scorer.step_threads is set from actor.compute_threads"),
    ("rule_scorer", {"attention_pairs_per_s": 0}, "attention_pairs_per_s must be > 0"),
])
def test_a_bad_section_field_fails_the_build_naming_it(section, fields, naming):
    with pytest.raises(ValidationError, match=naming.replace(".", r"\.")):
        AppArgs.model_validate(BASE | {section: fields})


def test_sections_from_yaml_reach_the_components_frozen_with_the_derived_fields_set_once():
    args = AppArgs.model_validate(BASE | {
        "policy": {"max_batch": 4, "hot_overrides": [["m", 2, 0]]},
        "actor": {"num_cpus": 1, "resources": {"zq_slot": 1}, "compute_threads": 2},
        "registry": {"adopt_grace_s": 7.0},
        "telemetry": {"poll_interval_s": 0.5},
        "rule_scorer": {"actor_start_s": 2.0},
    })
    config = ingress_config(args)
    assert config.policy.hot_overrides == (("m", 2, 0),)
    assert config.actor.resources == (("zq_slot", 1.0),)
    assert (config.actor.max_batch, config.actor.namespace) == (4, "ns")  # from policy and the namespace
    assert (config.registry.adopt_grace_s, config.registry.namespace, config.registry.actor_namespace) == (7.0, "ns",
                                                                                                             "ns")
    assert config.telemetry.poll_interval_s == 0.5 and config.rule_scorer.actor_start_s == 2.0
    assert config.rule_scorer.step_threads == 2  # the threads the actors step on, which the constants were fitted on
    with pytest.raises(AttributeError):
        config.policy.max_batch = 1  # frozen


def test_every_deadline_and_interval_of_the_args_reaches_the_ingress_config_under_its_name():
    args = AppArgs.model_validate(BASE | {"token_timeout_s": 7.0, "registry_heartbeat_s": 3.0,
                                          "warm_refresh_s": 9.0, "max_body_bytes": 4096})
    config = ingress_config(args)
    assert (config.token_timeout_s, config.registry_heartbeat_s, config.warm_refresh_s,
            config.max_body_bytes) == (7.0, 3.0, 9.0, 4096)


def test_the_ingress_deployment_can_autoscale_instead_of_a_fixed_count(tmp_path):
    from serve_app.app import build_app

    args = {"models": [{"id": "m", "demo_preset": "tiny", "demo_dir": str(tmp_path)}]}
    fixed = build_app(args | {"num_replicas": 2})._bound_deployment._deployment_config
    assert fixed.num_replicas == 2 and fixed.autoscaling_config is None
    scaled = build_app(args | {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                                      "target_ongoing_requests": 64}})
    config = scaled._bound_deployment._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (1, 4, 64)
    with pytest.raises(ValueError, match="not both"):
        build_app(args | {"num_replicas": 2, "autoscaling_config": {"max_replicas": 4}})
    with pytest.raises(Exception, match="max_replicas"):  # Serve's own check of its config
        build_app(args | {"autoscaling_config": {"min_replicas": 5, "max_replicas": 2}})


def test_a_ttft_target_no_fresh_actor_can_meet_needs_warm_actors_or_the_build_fails():
    """Under the rule a fresh actor's TTFT is at least its process start: with no warm actor, every request
    would be refused and no actor ever started for the model."""
    tight = BASE | {"models": [{"id": "m", "zqs_path": "m.zqs", "ttft_target_s": 1.0}],
                    "rule_scorer": {"actor_start_s": 1.6}}
    with pytest.raises(ValidationError, match="no actor would ever be started"):
        AppArgs.model_validate(tight)
    AppArgs.model_validate(tight | {"policy": {"num_warm_short_actors": 1}})  # warm actors meet it
    AppArgs.model_validate(tight | {"rule_scorer": {"actor_start_s": 0.5}})  # a start within the target
