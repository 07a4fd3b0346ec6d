"""What several test modules share, in one place.

- Builders for the pure decision: a policy (`policy(**overrides)` on the tests' base values), request
  features, slots, actors and snapshots.
- Random scenarios for property tests of `decide`, and the feasibility every decision must have.
- A scorer booster trained on a synthetic law.
- Deploying an app on Serve, and clearing a namespace's named actors after it.

Ray, numpy and XGBoost are imported where used, so that the pure tests stay free of them.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import strategies as st

from serve_app.decisions import Bind, Dispatch, Join, Spawn
from serve_app.policy import PolicyConfig
from serve_app.snapshot import ActorView, ClusterSnapshot, RequestFeatures, RowView, SlotView

# ---------------------------------------------------------------- the pure decision

# Short: input <= 100 and max_tokens <= 50; one hot short actor; no per-process overhead; one actor a slot.
BASE_POLICY: dict[str, Any] = {"short_max_input_tokens": 100, "short_max_output_tokens": 50, "max_hot_short_actors": 1,
                               "actor_overhead_bytes": 0, "max_actors_per_slot": 1}


def policy(**overrides: Any) -> PolicyConfig:
    """The tests' base policy (`BASE_POLICY`), with what a module needs changed."""
    return PolicyConfig(**{**BASE_POLICY, **overrides})


def features(input_tokens=10, max_tokens=10, weight_bytes=1000, kv_bytes_per_token=1, workspace_bytes=0,
             model="m", **kw) -> RequestFeatures:
    """A short request by `policy()` (10 + 10 tokens) for a 1000-byte model, 1 KV byte a token."""
    return RequestFeatures(model, input_tokens, max_tokens, weight_bytes, kv_bytes_per_token, workspace_bytes, **kw)


def slot(slot_id, total=10_000, reserved=0, num_actors=0) -> SlotView:
    return SlotView(slot_id, "node", total, reserved, num_actors)


def actor(name, slot_id, state="idle", lane="short", model="m", is_hot=True, reserved=1000, rows=None,
          row_tokens=20, tpot=None) -> ActorView:
    """An actor; a busy or starting one runs `rows` rows (default 1) of `row_tokens` KV positions each."""
    num_rows = (0 if state == "idle" else 1) if rows is None else rows
    views = tuple(RowView(row_tokens, row_tokens, tpot, 0.0) for _ in range(num_rows))
    return ActorView(name, model, slot_id, state, lane, is_hot, reserved, views)


def snapshot(slots, actors=()) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(slots), tuple(actors), 1)


# ---------------------------------------------------------------- random scenarios and feasibility

# The scenarios' lane bounds: short is input <= 10 and max_tokens <= 10 (what `feasible` assumes).
SCENARIO_SHORT_MAX_TOKENS = 10


@st.composite
def scenarios(draw):
    """(features, snapshot, policy): up to 6 slots and 6 actors in every state, and a random policy."""
    num_slots = draw(st.integers(0, 6))
    slots = []
    for i in range(num_slots):
        total = draw(st.integers(0, 4000))
        slots.append(SlotView(f"s{i}", "n", total, draw(st.integers(0, total)), draw(st.integers(0, 2))))
    actors = []
    for i in range(draw(st.integers(0, 6)) if slots else 0):
        state = draw(st.sampled_from(["starting", "busy", "idle", "warm", "warming"]))
        num_rows = {"idle": 0, "warm": 0, "warming": 0, "starting": 1, "busy": draw(st.integers(1, 4))}[state]
        rows = tuple(RowView(10, draw(st.integers(1, 40)), draw(st.one_of(st.none(), st.floats(0.001, 1))), 0.0)
                     for _ in range(num_rows))
        actors.append(ActorView(f"a{i}", draw(st.sampled_from(["m", "m2"])), draw(st.sampled_from(slots)).slot_id,
                                state, draw(st.sampled_from(["short", "long"])),
                                state == "idle" or (state not in ("warm", "warming") and draw(st.booleans())),
                                100, rows, draw(st.floats(0.0, 1.0))))
    request = features(input_tokens=draw(st.integers(1, 20)), max_tokens=draw(st.integers(1, 20)),
                       weight_bytes=draw(st.integers(0, 3000)), kv_bytes_per_token=draw(st.integers(0, 30)),
                       workspace_bytes=draw(st.integers(0, 300)))
    config = PolicyConfig(short_max_input_tokens=SCENARIO_SHORT_MAX_TOKENS,
                          short_max_output_tokens=SCENARIO_SHORT_MAX_TOKENS,
                          max_hot_short_actors=draw(st.integers(0, 2)), max_hot_long_actors=draw(st.integers(0, 2)),
                          actor_overhead_bytes=0, max_actors_per_slot=draw(st.integers(1, 2)),
                          max_candidates=draw(st.integers(1, 3)), max_batch=draw(st.integers(1, 4)))
    return request, ClusterSnapshot(tuple(slots), tuple(actors), 0), config


def feasible(features, snap, policy):
    """Every feasible placement, found without `decide`'s code: hot actors, joinable batches, cold slots, in order."""
    is_short = (features.input_tokens <= SCENARIO_SHORT_MAX_TOKENS
                and features.max_tokens <= SCENARIO_SHORT_MAX_TOKENS)
    free = {s.slot_id: s.total_bytes - s.reserved_bytes for s in snap.slots}
    hot = [a.name for lane in (("short", "long") if is_short else ("long",)) for a in snap.actors
           if a.lane == lane and a.model == features.model and a.state == "idle"
           and free[a.slot_id] >= features.dispatch_bytes]
    joins = [a for a in snap.actors
             if a.lane == ("short" if is_short else "long") and a.model == features.model and a.state == "busy"
             and a.is_hot and a.num_rows < policy.max_batch and policy.max_batch > 1
             and free[a.slot_id] >= features.dispatch_bytes]
    cold = [s.slot_id for s in snap.slots
            if free[s.slot_id] >= features.spawn_bytes and s.num_actors < policy.max_actors_per_slot]
    return hot, joins, cold


def idle_short_lane_for_long(features, snap):
    """Idle short-lane actors of the model that fit a *long* request: its last resort before a refusal or an
    eviction (none for a short request, which finds them among `feasible`'s hot ones)."""
    if (features.input_tokens <= SCENARIO_SHORT_MAX_TOKENS and features.max_tokens <= SCENARIO_SHORT_MAX_TOKENS):
        return []
    free = {s.slot_id: s.total_bytes - s.reserved_bytes for s in snap.slots}
    return [a.name for a in snap.actors if a.lane == "short" and a.model == features.model and a.state == "idle"
            and free[a.slot_id] >= features.dispatch_bytes]


def warm_and_evictable(features, snap, policy):
    """Warm, then warming, actors of the model that fit (any lane), and slots whose idle or warm actors could
    all be retired."""
    free = {s.slot_id: s.total_bytes - s.reserved_bytes for s in snap.slots}
    warm = [a.name for a in snap.actors
            if a.model == features.model and a.state == "warm" and free[a.slot_id] >= features.dispatch_bytes]
    warming = [a.name for a in snap.actors
               if a.model == features.model and a.state == "warming" and free[a.slot_id] >= features.dispatch_bytes]
    evictable = {}
    for s in snap.slots:
        on_slot = [a for a in snap.actors if a.slot_id == s.slot_id]
        if on_slot and all(a.state in ("idle", "warm", "warming") for a in on_slot) and not any(
                a.state != "idle" and a.model == features.model for a in on_slot) and (
                free[s.slot_id] + sum(a.reserved_bytes for a in on_slot) >= features.spawn_bytes
                and s.num_actors - len(on_slot) < policy.max_actors_per_slot):
            evictable[s.slot_id] = tuple(a.name for a in on_slot)
    return warm + warming, evictable


def check_feasible(d, features, snap, policy):
    """Assert that the decision `d` is one of the feasible placements, or a refusal when there is none.

    Returns `feasible`'s (hot, joins, cold)."""
    hot, joins, cold = feasible(features, snap, policy)
    warm, evictable = warm_and_evictable(features, snap, policy)
    has_targets = any(t is not None for t in (features.ttft_target_s, features.total_target_s, features.tpot_target_s))
    usable_warm = [] if has_targets else warm  # a warm actor predicted to miss the request's targets is passed by
    last_resort = idle_short_lane_for_long(features, snap)
    usable_last_resort = [] if has_targets else last_resort
    if isinstance(d, Bind):
        placed = next(a for a in snap.actors if a.name == d.actor_name)
        assert d.actor_name in warm and d.slot_id == placed.slot_id and d.reserve_bytes == features.dispatch_bytes
    elif isinstance(d, Spawn) and d.evict:
        assert not hot and not joins and not cold and not usable_warm and not usable_last_resort, (
            "evicted with a place to go")
        assert evictable.get(d.slot_id) == d.evict and d.reserve_bytes == features.spawn_bytes
    elif isinstance(d, Dispatch):
        placed = next(a for a in snap.actors if a.name == d.actor_name)
        assert d.slot_id == placed.slot_id and d.reserve_bytes == features.dispatch_bytes
        if d.actor_name not in hot:  # a long request's last resort (before a warm actor, whose pool would refill)
            assert d.actor_name in last_resort and (has_targets or not (joins or cold)), d
    elif isinstance(d, Join):
        placed = next(a for a in snap.actors if a.name == d.actor_name)
        assert placed in joins and d.slot_id == placed.slot_id and d.reserve_bytes == features.dispatch_bytes
    elif isinstance(d, Spawn):
        assert d.slot_id in cold and d.reserve_bytes == features.spawn_bytes
    elif d.reason == "latency_target":  # only a running row's TPOT target can refuse with no target of its own
        assert (joins or (evictable and has_targets)) and not hot and not cold and not usable_warm and (
            not usable_last_resort)
    else:
        assert not hot and not joins and not cold and not usable_warm and not evictable and not usable_last_resort, (
            f"rejected ({d.reason}) with feasible {hot} {joins} {cold} {warm} {evictable} {last_resort}")
        is_too_large = bool(snap.slots) and features.spawn_bytes > max(s.total_bytes for s in snap.slots)
        assert d.reason == ("too_large" if is_too_large else "no_capacity")
    return hot, joins, cold


# ---------------------------------------------------------------- a scorer trained on a synthetic law


def synthetic_law(kind, utilization, batch_rows, kv_read_bytes, max_tokens):
    """Synthetic truth. Hot: first token at once, but decodes slowly on a busy slot. Cold: 2 s to the first
    token. Join: a step of the batch first; each step slower by its rows and, mostly, the KV bytes it reads."""
    import numpy as np

    join_step = 0.01 * (1 + 0.1 * batch_rows) + kv_read_bytes * 2e-5
    tpot = np.select([kind == 0, kind == 1], [0.01 * (1 + 10 * utilization), join_step], 0.01)
    ttft = np.select([kind == 0, kind == 1], [0.1, 0.1 + join_step], 2.0)
    return ttft, ttft + max_tokens * tpot, tpot


def train_synthetic_scorer(names=None, num_targets=3, seed=0):
    """A booster that learnt `synthetic_law` (kind 0 hot, 1 join, 2 cold), with `names` (default: the scorer's
    FEATURE_NAMES) for its columns."""
    import numpy as np
    import xgboost as xgb

    from serve_app.xgb_scorer import FEATURE_NAMES

    names = FEATURE_NAMES if names is None else names
    column = {name: i for i, name in enumerate(FEATURE_NAMES)}
    rng = np.random.default_rng(seed)
    n = 8000
    kind = rng.integers(0, 3, n)
    utilization = rng.choice([0.0, 0.9], n)
    rows = np.where(kind == 1, rng.integers(1, 8, n), 0)
    tokens = np.where(kind == 1, rng.integers(50, 5000, n), 0)
    kv_per_token = rng.choice([1, 4, 512], n)  # 512: the tiny test model's, which the app test serves
    max_tokens = rng.integers(1, 200, n)
    input_tokens = rng.integers(1, 1000, n)
    kv_read_bytes = (tokens + input_tokens + max_tokens) * kv_per_token  # the step's reads, the request's row in it
    columns = {"is_cold": kind == 2, "is_join": kind == 1, "slot_utilization": utilization, "batch_rows": rows,
               "batch_tokens": tokens, "batch_kv_read_bytes": kv_read_bytes,
               "input_tokens": input_tokens, "max_tokens": max_tokens,
               "kv_bytes_per_token": kv_per_token}
    x = np.zeros((n, len(names)), dtype=np.float32)
    for name, values in columns.items():  # by position, so a renamed or shorter set still gets the law's columns
        if column[name] < len(names):
            x[:, column[name]] = values
    y = np.log(np.stack(synthetic_law(kind, utilization, rows, kv_read_bytes, max_tokens), 1))[:, :num_targets]
    params = {"max_depth": 5, "eta": 0.3, "tree_method": "hist", "nthread": 1}
    return xgb.train(params, xgb.DMatrix(x, y, feature_names=list(names)), 200)


# ---------------------------------------------------------------- apps on Serve, and their namespace


# One Serve instance serves the whole session, its proxy on this port: each module deploys its app
# there and deletes it afterwards (`undeploy`), instead of starting Serve and shutting it down again.
# Under `make test` each xdist worker that runs tests on Ray has a cluster and a Serve of its own, so
# its own port (gw0 -> 8780, gw1 -> 8781, ...).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
SERVE_PORT = 8780 + int(_WORKER[2:]) if _WORKER.startswith("gw") else 8766


def is_settled(snap: ClusterSnapshot, alive: set[str]) -> bool:
    """Nothing running or leaked: no request holds a row (a free row leased to a replica holds none; it
    returns once that replica's demand has gone), no actor is starting but an unused start lease's (its
    one row free), every slot's reservation is its actors' sum, and no actor is alive that the books do
    not know."""
    known = {a.name for a in snap.actors}
    is_idle = all(all(r.num_tokens == 0 for r in a.rows)
                  and (a.state in ("idle", "warm", "warming") or (a.state == "busy" and a.is_hot)
                       or (a.state == "starting" and a.rows))
                  for a in snap.actors)
    is_reserved_by_actors = all(s.reserved_bytes == sum(a.reserved_bytes for a in snap.actors
                                                        if a.slot_id == s.slot_id) for s in snap.slots)
    return is_idle and is_reserved_by_actors and alive <= known


def run_app(port: int, name: str, app) -> str:
    """Run the built `app` as `name`, at "/", on the session's Serve (started here if it is not running);
    its base URL. `port` is the session's SERVE_PORT: a running proxy keeps the port it was started on."""
    from ray import serve

    if port != SERVE_PORT:
        raise ValueError(f"apps run on the session's Serve at port {SERVE_PORT}, not {port}")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app, name=name, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def named_actors(ray, namespace: str) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}


def request_actors(ray, namespace: str) -> set[str]:
    """The request actors alive in Ray's table in `namespace`."""
    from serve_app.registry import is_request_actor_name

    return {name for name in named_actors(ray, namespace) if is_request_actor_name(name)}


def kill_namespace(ray, namespace: str) -> None:
    """Kill every named actor left in `namespace` (detached actors outlive the app that started them)."""
    for name in named_actors(ray, namespace):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
        except ValueError:  # gone meanwhile
            pass


def undeploy(ray, namespace: str | None = None) -> None:
    """Delete every app on the session's Serve (each one's last replica takes its actors and registry with
    it), keeping Serve itself for the next module; then clear `namespace`'s actors."""
    from ray import serve

    try:
        names = list(serve.status().applications)
    except Exception:  # noqa: BLE001  (Serve is not running: a test shut it down, nothing is deployed)
        names = []
    for name in names:
        serve.delete(name)
    if namespace is not None:
        kill_namespace(ray, namespace)


def metrics_export_port(ray) -> int:
    """Where this (one-node) cluster exports its Prometheus metrics, from Ray's public node table."""
    return next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])


def run_scenario(script, args: list[str], timeout_s: float) -> tuple[dict | None, str]:
    """Run a scenario script that starts a Ray cluster of its own, in a session of its own (this process
    holds the session's local Ray); its `ZQ-RESULT {json}` (None if it printed none) and its output's tail.

    Past `timeout_s` its whole process group is killed: the scenario and every Ray process it started. A
    cluster it started may leave Ray's "current cluster" address file pointing at itself: the file is put
    back as it was, so later `ray.init()` calls on this machine are not sent to a cluster that is gone."""
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    address_file = Path("/tmp/ray/ray_current_cluster")
    previous = address_file.read_text() if address_file.exists() else None
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=Path(__file__).resolve().parents[1], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started: the scenario and its Ray
        out, _ = proc.communicate()
        out += f"\n[killed after {timeout_s} s]"
    finally:
        if previous is None:
            address_file.unlink(missing_ok=True)
        elif not address_file.exists() or address_file.read_text() != previous:
            address_file.write_text(previous)
    lines = [x for x in out.splitlines() if x.startswith("ZQ-RESULT ")]
    result = json.loads(lines[-1].removeprefix("ZQ-RESULT ")) if lines else None
    return result, out[-6000:]


def emit_result(result: dict) -> int:
    """A scenario's result, as the one line `run_scenario` reads."""
    import json

    print("ZQ-RESULT " + json.dumps(result), flush=True)
    return 0


def end_scenario(cluster, tmp) -> None:
    """A scenario's teardown: Serve, then this driver's connection (before the cluster it is connected to:
    a driver left behind aborts when its GCS goes), then the cluster, then its temp dir."""
    import shutil

    import ray
    from ray import serve

    try:
        serve.shutdown()
    except Exception:  # Serve never started, or went with a failed start
        pass
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
