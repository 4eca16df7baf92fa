"""deploy/grafana without a Docker engine: the dashboard parses, every query names a metric the coordinator
exports, and the compose file's `metrics` profile provisions Grafana with it and with Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath
from typing import Any

import yaml

from demonet.coordinator.metrics import Metrics
from tests.deploy.common import DEPLOY, load_compose

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "demonet.json"
COMPOSE = load_compose(DEPLOY / "compose.yaml")
# PromQL words that are not metric names: aggregations' and functions' names are followed by "(" and
# dropped below; these are the keywords that are not.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def _queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads: identifiers that are not functions, keywords, label names
    (inside {...} or after by/without) or durations ([5m])."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if m.group() in KEYWORDS or expr[m.end():].lstrip().startswith("("):
            continue
        if m.start() > 0 and (expr[m.start() - 1].isdigit() or expr[m.start() - 1] == "."):
            continue  # the exponent of a number (1e3)
        names.add(m.group())
    return names


def _exported() -> set[str]:
    """Every sample name the coordinator's registry exposes (counters' _total, histograms' _bucket/_sum/_count)."""
    return {s.name for family in Metrics().registry.collect() for s in family.samples}


def test_the_parser_finds_metric_names_and_only_them() -> None:
    assert metric_names('histogram_quantile(0.95, sum by (le) (rate(demonet_close_seconds_bucket{job="x"}[5m])))') \
        == {"demonet_close_seconds_bucket"}
    assert metric_names("rate(a_total[1m]) * 60 / on (instance) b + 1e3") == {"a_total", "b"}


def test_the_dashboard_parses_and_every_query_reads_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 10 and dashboard["uid"] and dashboard["title"]
    exported = _exported()
    for expr in queries:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{expr!r} reads {sorted(names - exported)}, which the coordinator does not export"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # Every panel and query reads the data source that provisioning creates.
    source = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])


def test_the_metrics_profile_provisions_grafana_with_prometheus_and_the_dashboard() -> None:
    grafana, prometheus = COMPOSE["services"]["grafana"], COMPOSE["services"]["prometheus"]
    assert grafana["profiles"] == prometheus["profiles"] == ["metrics"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    provisioning = DEPLOY / mounts["/etc/grafana/provisioning"]
    source = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"][0]
    prom_port = int(prometheus["ports"][0].rsplit(":", 1)[1].strip('"'))
    assert source["url"] == f"http://prometheus:{prom_port}" and source["type"] == "prometheus"
    provider = yaml.safe_load((provisioning / "dashboards/demonet.yml").read_text())["providers"][0]
    folder = PurePosixPath(provider["options"]["path"])
    assert str(folder) in mounts, (folder, mounts)
    assert (DEPLOY / mounts[str(folder)] / DASHBOARD.name).is_file()
    home = PurePosixPath(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == folder and (DEPLOY / mounts[str(folder)] / home.name).is_file()
    assert all(v.endswith(":ro") for v in grafana["volumes"] if not v.startswith("grafana-data"))
    assert "grafana-data" in COMPOSE["volumes"]
