"""deploy/kubernetes/generated/: what generate.py writes, equal to dashboards/, usable by the operator and Grafana."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import BASE, DASHBOARD, OPERATOR_API, OPERATOR_DURATION, RULES, generator, kustomization

PROMETHEUS_RULE = BASE / "generated" / "prometheusrule.yaml"
DASHBOARD_COPY = BASE / "generated" / "torchpulse.json"
# The most a ConfigMap may hold (etcd's object limit as the API server enforces it for ConfigMaps).
CONFIGMAP_MAX_BYTES = 1 << 20
STALE = "stale: run `python deploy/kubernetes/generate.py` and commit its output"


def test_generated_copies_are_what_the_generator_writes() -> None:
    """Both copies hold exactly what generate.py makes of the current dashboards/ files."""
    module = generator()

    stale = module.stale(module.outputs())

    assert [] == [path.relative_to(BASE).as_posix() for path in stale], STALE


def test_prometheusrule_groups_are_the_rules_files_groups() -> None:
    """The PrometheusRule's spec is the parsed rules file: the same groups, rules, labels and annotations."""
    rules = yaml.safe_load(RULES.read_text())
    resource = yaml.safe_load(PROMETHEUS_RULE.read_text())

    assert {"groups"} == set(rules)
    assert rules == resource["spec"], STALE
    assert (OPERATOR_API, "PrometheusRule", "torchpulse") == (
        resource["apiVersion"],
        resource["kind"],
        resource["metadata"]["name"],
    )


def test_prometheusrule_fits_the_operators_schema() -> None:
    """What the CRD asks beyond Prometheus: string labels and annotations, its duration pattern, unique group names."""
    groups: list[dict[str, Any]] = yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]

    problems = [
        f"{rule.get('alert') or rule.get('record')}: {key} {name}={value!r}"
        for rule in rules
        for key in ("labels", "annotations")
        for name, value in rule.get(key, {}).items()
        if not isinstance(value, str)
    ]
    durations = [group["interval"] for group in groups if "interval" in group] + [
        rule["for"] for rule in rules if "for" in rule
    ]

    assert [] == problems
    assert [] == [duration for duration in durations if not OPERATOR_DURATION.fullmatch(str(duration))]
    assert len(groups) == len({group["name"] for group in groups})
    assert [] == [rule for rule in rules if ("alert" in rule) == ("record" in rule) or "expr" not in rule]


def test_dashboard_configmap_carries_the_dashboard_for_the_sidecar() -> None:
    """The ConfigMap holds the dashboard file byte for byte, labelled for Grafana's sidecar, under the size limit."""
    (generated,) = [entry for entry in kustomization()["configMapGenerator"] if entry["name"] == "torchpulse-dashboard"]
    dashboard: dict[str, Any] = json.loads(DASHBOARD_COPY.read_text())

    assert DASHBOARD.read_bytes() == DASHBOARD_COPY.read_bytes(), STALE
    assert (["generated/torchpulse.json"], {"grafana_dashboard": "1"}) == (
        generated["files"],
        generated["options"]["labels"],
    )
    assert generated["options"]["disableNameSuffixHash"] is True
    assert DASHBOARD_COPY.stat().st_size < CONFIGMAP_MAX_BYTES
    # Provisioned dashboards are not imported: an import placeholder (${DS_...}) would stay unresolved.
    assert "__inputs" not in dashboard
    assert "${DS_" not in DASHBOARD_COPY.read_text()


@pytest.mark.parametrize(
    "text",
    ["---\ngroups: []\n", "groups: []\n---\ngroups: []\n", "%YAML 1.2\n---\ngroups: []\n", "other: 1\ngroups: []\n"],
)
def test_generator_refuses_a_rules_file_it_cannot_indent(text: str) -> None:
    """A second document, a directive or another top-level key would change meaning under `spec`: refused."""
    module = generator()

    with pytest.raises(module.NotEmbeddable):
        module.rules_resource(text)


def test_generator_keeps_literal_blocks_and_their_inner_spaces() -> None:
    """Indenting under `spec` keeps every value, blank lines and space-only lines of literal blocks included."""
    rules = (
        "# why\ngroups:\n  - name: g\n    rules:\n      - record: r\n"
        "        expr: |\n          a\n\n             \n          b\n"
    )

    resource = yaml.safe_load(generator().rules_resource(rules))

    assert yaml.safe_load(rules) == resource["spec"]
