"""configs/rayservice.yaml: valid against KubeRay's RayService CRD, and the same app as configs/serve.yaml.

The CRD sees `serveConfigV2` as an opaque string, so the app inside it is checked here
three ways: against `configs/serve.yaml` (equal but for the documented GPU-cluster
overrides), through the app's own argument validation, and through Ray Serve's schema.
"""

from __future__ import annotations

import copy
import importlib.metadata
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).parents[2]
MANIFEST = REPO / "configs" / "rayservice.yaml"
SERVE_CONFIG = REPO / "configs" / "serve.yaml"
# CI layout: a copy of shared/ sits beside the clone.
CRD = REPO.parent / "shared" / "schemas" / "ray.io_rayservices.yaml"

MiB = 1 << 20

# What legitimately differs on a GPU cluster, as (key path into the app) -> the manifest's value.
# Any other difference between the two apps fails the test; so does an override that no longer
# changes anything (configs/serve.yaml moved on and the manifest did not).
GPU_OVERRIDES: dict[tuple[str | int, ...], Any] = {
    ("args", "slots", "kind"): "gpu",  # one slot per GPU, never CPU slots
    ("args", "actor", "num_gpus"): 1,  # a request actor owns its GPU
    # serve.yaml splits a 2-core host into a CPU slot per core; a GPU's actor keeps two cores for its host side.
    ("args", "slots", "num_cpu_slots"): 1,
    ("args", "actor", "num_cpus"): 2,
    ("args", "actor", "load_threads"): 2,
    ("args", "policy", "actor_overhead_bytes"): 512 * MiB,  # a CUDA context, not a CPU process
    # Baked into the image (Dockerfile): the same bytes at the same absolute path on every pod,
    # where the ingress (head) checks the file and actors on the GPU workers open it.
    ("args", "models", 0, "zqs_path"): "/opt/zeroqueue/models/smollm2-135m-instruct.zqs",
    # The rule's constants were measured on a CPU: on GPUs it keeps its defaults.
    ("args", "rule_scorer"): {},
    # The API listens beyond loopback: every route needs the key, read from the head's env (a Secret).
    ("args", "api_key_env"): "ZQ_API_KEY",
    # Each GPU the planner may add keeps a hot actor.
    ("args", "policy", "max_hot_short_actors"): 8,
    # GPU workers come and go with the demand (test_gpu_workers_follow_the_capacity_planner).
    ("args", "capacity"): {"is_enabled": True, "min_slots": 1, "max_slots": 8, "node_start_s": 180,
                           "demand_window_s": 30, "scale_down_delay_s": 120},
}


def _load_yaml(path: Path) -> Any:
    # The CRD is ~1 MB of YAML: the C loader reads it ~10x faster than the pure-Python one.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as f:
        return yaml.load(f, Loader=loader)


def _strict(schema: dict) -> dict:
    """An openAPIV3Schema node as JSON Schema, as strict as `kubectl apply --validate=strict`.

    The API server prunes unknown fields silently; here they are errors, so a misspelt key
    (`rayStartParam`) fails instead of vanishing.  `x-kubernetes-*` keywords are dropped:
    int-or-string nodes already carry their `anyOf`, and the CEL rules only guard fields this
    manifest does not set.
    """
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema:
        out["properties"] = {name: _strict(s) for name, s in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        out["items"] = _strict(schema["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [_strict(s) for s in schema[key]]
    if schema.get("nullable") and "type" in schema:
        out["type"] = [schema["type"], "null"]
    return out


@pytest.fixture(scope="module")
def crd() -> dict:
    if not CRD.is_file():
        pytest.skip(f"KubeRay RayService CRD not found at {CRD} (expected a copy of shared/ beside the repo)")
    return _load_yaml(CRD)


@pytest.fixture(scope="module")
def validator(crd: dict) -> jsonschema.Draft7Validator:
    version = next(v for v in crd["spec"]["versions"] if v["storage"])
    schema = _strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def manifest() -> dict:
    return _load_yaml(MANIFEST)


@pytest.fixture(scope="module")
def serve_config(manifest: dict) -> dict:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


@pytest.fixture(scope="module")
def local_config() -> dict:
    return _load_yaml(SERVE_CONFIG)


def _errors(validator: jsonschema.Draft7Validator, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _groups(manifest: dict) -> tuple[dict, list[dict]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    return cluster["headGroupSpec"], cluster["workerGroupSpecs"]


_ABSENT = object()


def _get(tree: Any, path: tuple[str | int, ...]) -> Any:
    """The value at `path`, or `_ABSENT` where its last key is missing."""
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    try:
        return parent[path[-1]]
    except (KeyError, IndexError):
        return _ABSENT


def _set(tree: Any, path: tuple[str | int, ...], value: Any) -> None:
    _get(tree, path[:-1])[path[-1]] = value


def test_manifest_is_valid_against_the_crd(
    crd: dict, validator: jsonschema.Draft7Validator, manifest: dict
) -> None:
    served = {v["name"] for v in crd["spec"]["versions"] if v["served"]}
    group, version = manifest["apiVersion"].split("/")
    assert group == crd["spec"]["group"] and version in served, manifest["apiVersion"]
    assert manifest["kind"] == crd["spec"]["names"]["kind"]
    assert manifest["metadata"]["name"]  # the CRD leaves metadata to the API server
    assert _errors(validator, manifest) == []


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParam"), {}, "rayStartParam"),
        (
            ("spec", "rayClusterConfig", "headGroupSpec", "rayStartParams", "metrics-export-port"),
            8080,
            "not of type",
        ),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "maxReplicas"), "two", "not of type"),
        (("spec", "serveConfigV2"), {"applications": []}, "not of type"),
    ],
)
def test_the_validation_rejects_broken_manifests(
    validator: jsonschema.Draft7Validator, manifest: dict, path: tuple, value: Any, expected: str
) -> None:
    broken = copy.deepcopy(manifest)
    _set(broken, path, value)
    errors = _errors(validator, broken)
    assert any(expected in e for e in errors), errors


def test_a_worker_group_needs_a_name(validator: jsonschema.Draft7Validator, manifest: dict) -> None:
    broken = copy.deepcopy(manifest)
    del broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    assert any("'groupName' is a required property" in e for e in _errors(validator, broken))


def test_serve_config_is_the_same_app_as_serve_yaml(serve_config: dict, local_config: dict) -> None:
    assert set(serve_config) == set(local_config)
    assert serve_config["proxy_location"] == local_config["proxy_location"]
    # The proxy must listen on the pod's address; the port is the one KubeRay's serve service targets.
    assert serve_config["http_options"] == {**local_config["http_options"], "host": "0.0.0.0"}

    (app,) = serve_config["applications"]
    (local_app,) = local_config["applications"]
    expected = copy.deepcopy(local_app)
    for path, value in GPU_OVERRIDES.items():
        assert _get(local_app, path) != value, f"override {path} no longer differs from configs/serve.yaml"
        _set(expected, path, value)
    assert app == expected


def test_serve_config_args_are_valid_app_args(serve_config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from serve_app.config import AppArgs, ingress_config

    (app,) = serve_config["applications"]
    monkeypatch.setenv(app["args"]["api_key_env"], "from-the-secret")  # as the Secret sets it on the head
    args = AppArgs.model_validate(app["args"])
    # `policy` and `actor` are free-form in AppArgs; building the frozen config checks their keys.
    config = ingress_config(args)
    assert config.slots.kind == "gpu"
    assert config.actor.num_gpus == 1
    assert config.policy.max_actors_per_slot == 1
    assert config.api_key == "from-the-secret"


def test_serve_config_is_valid_for_ray_serve(serve_config: dict) -> None:
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config)


def test_ray_version_is_the_installed_one(manifest: dict) -> None:
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == importlib.metadata.version("ray")


def test_head_has_no_gpus_and_exposes_serve_and_metrics(manifest: dict, serve_config: dict) -> None:
    head, _ = _groups(manifest)
    params = head["rayStartParams"]
    assert params["num-gpus"] == "0"
    for container in _containers(head):
        for kind in ("limits", "requests"):
            assert "nvidia.com/gpu" not in container.get("resources", {}).get(kind, {}), container["name"]
    ports = {p["name"]: p["containerPort"] for c in _containers(head) for p in c.get("ports", [])}
    assert ports["metrics"] == int(params["metrics-export-port"])
    assert ports["serve"] == serve_config["http_options"]["port"]
    assert "dashboard" in ports


def test_gpu_workers_hold_whole_gpus_and_follow_the_capacity_planner(manifest: dict, serve_config: dict) -> None:
    head, workers = _groups(manifest)
    assert workers, "no worker groups"
    # The planner states refused demand to KubeRay's autoscaler, which adds and removes GPU workers.
    config = manifest["spec"]["rayClusterConfig"]
    assert config["enableInTreeAutoscaling"] is True
    (app,) = serve_config["applications"]
    capacity, policy = app["args"]["capacity"], app["args"]["policy"]
    assert capacity["is_enabled"] is True
    # A worker goes back only once its actors retired (max_idle_s) and it then stayed idle this long.
    assert 0 < config["autoscalerOptions"]["idleTimeoutSeconds"] <= policy["max_idle_s"]
    num_gpus_per_actor = app["args"]["actor"]["num_gpus"]
    images = {c["image"] for c in _containers(head)}
    slots = [0, 0]
    for group in workers:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        (container,) = _containers(group)
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        num_gpus = int(limits["nvidia.com/gpu"])
        assert num_gpus >= 1 and num_gpus % num_gpus_per_actor == 0, group["groupName"]
        slots[0] += group["minReplicas"] * num_gpus // num_gpus_per_actor
        slots[1] += group["maxReplicas"] * num_gpus // num_gpus_per_actor
        # Kubernetes requires an extended resource's request to equal its limit.
        assert int(requests.get("nvidia.com/gpu", num_gpus)) == num_gpus
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"])
        assert container["image"] in images, "workers must run the head's image"
    # The planner's bounds are the worker groups' (one slot per GPU): it asks for nothing they cannot give.
    assert slots == [capacity["min_slots"], capacity["max_slots"]]
    # Every slot it may add keeps a hot actor: a grown cluster's requests do not each pay an actor's start.
    assert policy["max_hot_short_actors"] >= capacity["max_slots"]


def _mounts(group: dict) -> dict[str, str]:
    """mountPath -> the PersistentVolumeClaim behind it, for one pod template."""
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in group["template"]["spec"].get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    return {
        m["mountPath"]: claims[m["name"]]
        for c in _containers(group)
        for m in c.get("volumeMounts", [])
        if m["name"] in claims
    }


def test_every_pod_opens_the_same_model_file(manifest: dict, serve_config: dict) -> None:
    # The ingress (head) resolves a model's path and actors on GPU workers open that same path:
    # either a file baked into the image every pod runs, or one on a volume every pod mounts.
    from tests.unit.test_dockerfile import baked_models

    baked = baked_models()
    head, workers = _groups(manifest)
    pods = [_mounts(head)] + [_mounts(g) for g in workers]
    (app,) = serve_config["applications"]
    for model in app["args"]["models"]:
        # A demo preset would be synthesised by the ingress at start, on the head alone.
        assert model.get("zqs_path"), f"model {model['id']}: give a zqs_path on a GPU cluster"
        path = PurePosixPath(model["zqs_path"])
        assert path.is_absolute(), f"model {model['id']}: {path} depends on the process's working directory"
        claims = set()
        for mounts in pods:
            under = [claim for mount, claim in mounts.items() if path.is_relative_to(mount)]
            claims.add(under[0] if under else None)
        if claims == {None}:
            assert str(path) in baked, f"model {model['id']}: {path} is neither on a volume nor baked into the image"
        else:
            assert None not in claims, f"model {model['id']}: {path} is on a volume only some pods mount"
            assert len(claims) == 1, f"model {model['id']}: pods mount different claims at {path}: {claims}"


def test_the_api_key_comes_from_a_secret_on_the_pod_that_runs_the_ingress(manifest: dict, serve_config: dict) -> None:
    (app,) = serve_config["applications"]
    head, _ = _groups(manifest)
    env = {e["name"]: e for c in _containers(head) for e in c.get("env", [])}
    var = env[app["args"]["api_key_env"]]
    assert "value" not in var and var["valueFrom"]["secretKeyRef"] == {"name": "zeroqueue-api-key", "key": "api-key"}


def test_every_node_serves_the_direct_path_behind_serves_haproxy(manifest: dict) -> None:
    # Serve reads both in its controller and in each replica, wherever Ray places them: every node sets them.
    head, workers = _groups(manifest)
    for group in (head, *workers):
        env = {e["name"]: e.get("value") for c in _containers(group) for e in c.get("env", [])}
        assert env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1", group.get("groupName", "head")
        assert env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1", group.get("groupName", "head")
    ports = {p["name"]: p["containerPort"] for c in _containers(head) for p in c.get("ports", [])}
    assert ports["serve"] == 8000 and ports["serve-direct"] == 30000


def test_the_dashboard_and_its_jobs_api_need_rays_token(manifest: dict) -> None:
    assert manifest["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
