"""Elastic capacity on Ray's own autoscaler (its fake multi-node provider): refused demand brings a node,
requests are served on it with no redeploy, and once the load stops the node goes back.

The cluster runs in a subprocess (elastic_scenario.py): this pytest process may hold the session's
local Ray. The scenario's settings, which the bounds below are computed from: the planner's
node_start_s 5 s, demand_window_s 3 s, scale_down_delay_s 2 s; policy.max_idle_s 2 s; the
autoscaler's idle timeout 0.05 min (3 s); max_slots 1 on worker nodes of one slot each.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import run_scenario

SCENARIO = Path(__file__).with_name("elastic_scenario.py")
PORT = 8772
NODE_START_S = 5.0
# After the load's last request: its slot counts as busy for the demand window (3 s), the plan falls
# after the scale-down delay (2 s), the idle hot actor retires (max_idle_s 2 s, a reconcile pass 1 s),
# the autoscaler sees the node idle for its idle timeout (3 s) and ends it, and the registry drops the
# slot at its next reconcile pass (1 s). The sum is 12 s; on top, a margin for a slow or loaded CI machine
# where the GCS, two raylets, the autoscaler's 1 s update loop and Serve share the cores: 60 s. (This
# test's own print, on the 2-core machine it was written on: 12.7 s.)
BACK_TO_MIN_BOUND_S = 3 + 2 + 2 + 1 + 3 + 1 + 60.0
SCENARIO_TIMEOUT_S = 400


@pytest.mark.slow
def test_refused_demand_brings_a_node_that_serves_and_the_idle_node_goes_back():
    t0 = time.monotonic()
    result, tail = run_scenario(SCENARIO, ["--port", str(PORT), "--rate", "2", "--served", "3",
                                           "--node-start-s", str(NODE_START_S), "--demand-window-s", "3",
                                           "--scale-down-delay-s", "2", "--max-idle-s", "2",
                                           "--idle-timeout-min", "0.05",
                                           "--idle-watch-s", str(BACK_TO_MIN_BOUND_S + 10)], SCENARIO_TIMEOUT_S)
    assert result is not None, f"the scenario printed no result:\n{tail}"
    requests, timeline = result["requests"], [t for t in result["timeline"] if "error" not in t]
    summary = "\n".join(str(r) for r in requests) + "\n" + "\n".join(str(t) for t in timeline)

    # No request fails other than with a documented 503.
    assert all(r["status"] == 200 or (r["status"] == 503 and r["error_type"] == "overloaded_error")
               for r in requests), summary
    joined_at = next(t["t"] for t in timeline if t["slot_nodes"])
    asked_at = next(t["t"] for t in timeline if t["wanted"] >= 1)
    assert asked_at <= joined_at, summary  # the node came because the planner asked for it

    # The first requests found no slot: refused at once — answered before the node joined, not parked
    # until it did — quoting the node's start, not a slot's drain.
    first = requests[0]
    assert first["status"] == 503 and first["retry_after"] >= NODE_START_S, summary
    before = [r for r in requests if r["sent_s"] + r["took_s"] < joined_at]
    assert before and all(r["status"] == 503 for r in before), summary
    # While the node comes, a refusal quotes what is left of its start (never more than the first quote).
    assert all(r["retry_after"] <= first["retry_after"] for r in before), summary

    # Requests were served on the new node's slot, with no redeploy: the app's one deployment saw it join.
    served = [r for r in requests if r["status"] == 200]
    assert len(served) >= 3 and all(r["sent_s"] + r["took_s"] > joined_at for r in served), summary
    assert any(t["present"] == 1 and t["actors"] for t in timeline), summary

    # Load stopped: the plan fell to min_slots (0), the node went back within the bound, the registry forgot
    # its slot, and nothing the app placed was left (the registry and the head's telemetry agent only).
    load_end = result["phases"]["load_end_s"]
    final = result["final"]
    assert (final["wanted"], final["present"], final["slot_nodes"], final["actors"]) == (0, 0, 0, []), summary
    gone_at = next(t["t"] for t in timeline if t["t"] > load_end and t["slot_nodes"] == 0 and t["present"] == 0)
    assert gone_at - load_end <= BACK_TO_MIN_BOUND_S, summary
    assert [n for n in result["named_actors"] if not n.startswith("zq-telemetry-")] == ["zq-registry"], summary
    print(f"elastic: asked {asked_at:.1f} s, node joined {joined_at:.1f} s, {len(served)} served, back to 0 slots "
          f"{gone_at - load_end:.1f} s after the load; scenario {result['phases']}, "
          f"test {time.monotonic() - t0:.1f} s")
