"""configs/grafana.json charts exactly the metrics serve_app/metrics.py defines, by their exported names.

The metric definitions are read from the module's source (its `metrics.Histogram/Counter/Gauge`
calls), not by importing it: that would import Ray, and nothing here needs Ray running.
Ray exports a metric `zq_x` as `ray_zq_x`; a histogram as `ray_zq_x_bucket/_sum/_count`
with an `le` label; a counter keeps a name that already ends in `_total`, else gains it.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
DASHBOARD = REPO / "configs" / "grafana.json"
METRICS_SOURCE = REPO / "serve_app" / "metrics.py"
DATASOURCE_UID = "${DS_PROMETHEUS}"
GRID_WIDTH = 24
LOW_TAIL = frozenset({"zq_compute_density", "zq_step_threads"})  # fewer threads: a busy node

_SERIES = re.compile(r"\bray_[A-Za-z0-9_:]+")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"\bray_[A-Za-z0-9_:]+\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # Histogram | Counter | Gauge
    tag_keys: tuple[str, ...]

    def series(self) -> tuple[str, ...]:
        """The Prometheus series Ray exports for this metric."""
        base = f"ray_{self.name}"
        if self.kind == "Histogram":
            return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
        if self.kind == "Counter":
            return (base if base.endswith("_total") else f"{base}_total",)
        return (base,)


def defined_metrics(source: str) -> dict[str, Metric]:
    """Every `metrics.<Kind>("name", ..., tag_keys=(...))` call in the module's source."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("Histogram", "Counter", "Gauge")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "metrics"
        ):
            continue
        name = ast.literal_eval(node.args[0])
        tag_keys = next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "tag_keys"), ())
        found[name] = Metric(name, node.func.attr, tuple(tag_keys))
    return found


def expr_problems(expr: str, metrics: dict[str, Metric]) -> list[str]:
    """What is wrong with one PromQL expression against the defined metrics (empty: nothing)."""
    by_series = {s: m for m in metrics.values() for s in m.series()}
    used = _SERIES.findall(expr)
    problems = [f"{s} is not a series serve_app/metrics.py exports" for s in used if s not in by_series]
    if not used:
        problems.append("references no ray_zq_* metric")
    referenced = [by_series[s] for s in used if s in by_series]
    labels = {k for m in referenced for k in m.tag_keys}
    if any(s.endswith("_bucket") for s in used):
        labels.add("le")
    for group in _BY.findall(expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            if label not in labels:
                problems.append(f"groups by {label!r}, which none of {used} carries")
    for matchers in _SELECTOR.findall(expr):
        for label in _MATCHER_LABEL.findall(matchers):
            if label not in labels:
                problems.append(f"selects on {label!r}, which none of {used} carries")
    for m in referenced:
        if m.kind == "Histogram" and not re.search(rf"histogram_quantile\([^,]+,.*\b{m.series()[0]}\b", expr):
            problems.append(f"{m.name} is a histogram: chart quantiles of its _bucket series")
        if m.kind == "Histogram" and not re.search(r"\bby\s*\([^)]*\ble\b", expr):
            problems.append(f"{m.name}: histogram_quantile needs the sum kept by `le`")
        if m.kind == "Counter" and not re.search(rf"\b(?:rate|increase)\(\s*{m.series()[0]}\b", expr):
            problems.append(f"{m.name} is a counter: chart its rate, not its running total")
        if m.kind == "Gauge" and re.search(rf"\b(?:rate|increase)\(\s*{m.series()[0]}\b", expr):
            problems.append(f"{m.name} is a gauge: rate() of a gauge is meaningless")
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def metrics() -> dict[str, Metric]:
    found = defined_metrics(METRICS_SOURCE.read_text())
    assert found, f"no metrics.Histogram/Counter/Gauge calls found in {METRICS_SOURCE}"
    return found


def _panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' collapsed children included, rows themselves excluded."""
    out = []
    for panel in dashboard["panels"]:
        out.extend(panel.get("panels", []))
        if panel["type"] != "row":
            out.append(panel)
    return out


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p["targets"]]


def test_metric_definitions_parse_from_the_source(metrics: dict[str, Metric]) -> None:
    assert all(name.startswith("zq_") for name in metrics), sorted(metrics)
    assert {m.kind for m in metrics.values()} == {"Histogram", "Counter", "Gauge"}
    assert metrics["zq_dispatch_latency_seconds"].series()[0] == "ray_zq_dispatch_latency_seconds_bucket"


def test_dashboard_shape(dashboard: dict) -> None:
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    (source,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert (source["name"], source["query"]) == ("DS_PROMETHEUS", "prometheus")
    ids = [p["id"] for p in dashboard["panels"]] + [
        c["id"] for p in dashboard["panels"] for c in p.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_panels_query_prometheus_through_the_variable(dashboard: dict) -> None:
    for panel in _panels(dashboard):
        assert panel["datasource"]["uid"] == DATASOURCE_UID, panel["title"]
        assert panel["targets"], f"{panel['title']}: no queries"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == DATASOURCE_UID, panel["title"]


def test_panels_do_not_overlap(dashboard: dict) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= GRID_WIDTH, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_query_charts_a_defined_metric_correctly(dashboard: dict, metrics: dict[str, Metric]) -> None:
    problems = {e: p for e in _exprs(dashboard) if (p := expr_problems(e, metrics))}
    assert problems == {}


def test_query_variables_read_labels_the_metrics_carry(dashboard: dict, metrics: dict[str, Metric]) -> None:
    by_series = {s: m for m in metrics.values() for s in m.series()}
    for variable in (v for v in dashboard["templating"]["list"] if v["type"] == "query"):
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"])
        assert match, variable["definition"]
        series, label = match.groups()
        assert series in by_series and label in by_series[series].tag_keys, variable["definition"]
        assert variable["datasource"]["uid"] == DATASOURCE_UID


def test_every_defined_metric_is_charted(dashboard: dict, metrics: dict[str, Metric]) -> None:
    used = {s for e in _exprs(dashboard) for s in _SERIES.findall(e)}
    uncharted = [name for name, m in metrics.items() if not used & set(m.series())]
    assert uncharted == []


def test_quantile_panels_chart_p50_and_p99(dashboard: dict, metrics: dict[str, Metric]) -> None:
    for name, m in metrics.items():
        if m.kind != "Histogram":
            continue
        quantiles = {
            float(q)
            for e in _exprs(dashboard)
            for q in re.findall(rf"histogram_quantile\(([0-9.]+),[^;]*\b{m.series()[0]}\b", e)
        }
        # A density's bad tail is its low end: a request that waited more than it computed.
        assert quantiles == ({0.1, 0.5} if name in LOW_TAIL else {0.5, 0.99}), name


@pytest.mark.parametrize(
    "expr, expected",
    [
        ("sum(rate(ray_zq_dispatch_latency_seconds[5m]))", "not a series"),
        ("sum by (reason) (rate(ray_zq_errors_total[5m]))", "groups by 'reason'"),
        ('sum(rate(ray_zq_rejections_total{model="m"}[5m]))', "selects on 'model'"),
        ("sum(ray_zq_decisions_total)", "chart its rate"),
        ("rate(ray_zq_free_slots[5m])", "rate() of a gauge"),
        ("sum by (model) (rate(ray_zq_ttft_seconds_bucket[5m]))", "quantiles"),
        ("histogram_quantile(0.5, sum by (kind) (rate(ray_zq_ttft_seconds_bucket[5m])))", "by `le`"),
        ("sum(up)", "references no"),
    ],
)
def test_expr_checks_catch_broken_queries(metrics: dict[str, Metric], expr: str, expected: str) -> None:
    assert any(expected in p for p in expr_problems(expr, metrics)), expr_problems(expr, metrics)
