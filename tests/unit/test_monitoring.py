"""Alert rules (promtool), the generated dashboard and PrometheusRule, and `arena up`'s
scrape configuration, without a running stack (tests/e2e/test_monitoring.py has one)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from infra.monitoring import dashboard, rules, scrape, series

MONITORING = scrape.RULES.parent


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (.ci/run does)")
    return subprocess.run([tool, *args], capture_output=True, text=True, cwd=MONITORING, timeout=60, check=False)


def test_alert_rules_pass_promtool_check():
    out = promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 7 rules found" in out.stdout


def test_alert_rules_pass_their_promtool_unit_tests():
    out = promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_promtool_test():
    alerts = {r["alert"] for g in yaml.safe_load(scrape.RULES.read_text())["groups"] for r in g["rules"]}
    tested = yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"][0]["alert_rule_test"]
    assert alerts == {t["alertname"] for t in tested if t["exp_alerts"]}


def test_committed_dashboard_and_prometheus_rule_are_generated():
    assert dashboard.PATH.read_text() == dashboard.render(), "run: python -m infra.monitoring.dashboard"
    assert rules.PATH.read_text() == rules.render(), "run: python -m infra.monitoring.rules"
    panels = [p for p in dashboard.dashboard()["panels"] if p["type"] == "timeseries"]
    assert len({p["id"] for p in panels}) == len(panels) and all(p["targets"] for p in panels)


def test_a_query_of_a_series_nobody_exports_is_caught():
    text = "# HELP arena_req_total Chat requests\n# TYPE arena_req_total counter\n"
    text += "# HELP arena_batch_size Requests in a step\n# TYPE arena_batch_size histogram\n"
    text += 'arena_batch_size_bucket{le="1"} 0\n'
    exported = series.exported(text)
    assert {"arena_req_total", "arena_batch_size_bucket", "arena_batch_size_count"} <= exported
    good = "histogram_quantile(0.99, sum by (le) (rate(arena_batch_size_bucket[5m]))) / sum(rate(arena_req_total[1m]))"
    assert series.queried(good) <= exported
    assert series.queried("sum(rate(arena_req_totals[1m]))") - exported == {"arena_req_totals"}


def test_arena_up_scrape_config_is_valid_prometheus(tmp_path):
    targets = [scrape.Target("gateway", "gateway", 8000), scrape.Target("inference-0", "inference", 9101)]
    path = scrape.write(tmp_path, targets)
    groups = json.loads((tmp_path / "targets.json").read_text())
    assert groups[1] == {"targets": ["127.0.0.1:9101"], "labels": {"role": "inference", "process": "inference-0"}}
    out = promtool("check", "config", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
