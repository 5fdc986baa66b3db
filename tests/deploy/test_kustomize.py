"""`kubectl kustomize` renders the base, the example job and the overlay; every built-in object validates strictly."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import (
    BASE,
    DAEMON_CONFIG,
    DASHBOARD,
    EXAMPLES,
    HARDENED_CONTAINER,
    KUBERNETES_VERSIONS,
    OPERATOR_API,
    OVERLAY,
    RULES,
    Resource,
    config_disagreements,
    container,
    documents_of,
    effective_security,
    one,
    pod_spec,
    project_version,
    strict_validation_errors,
)

pytestmark = pytest.mark.process

# `labels:` with pairs and per-generator `options` need kustomize v5, which kubectl embeds from 1.27 on.
KUSTOMIZE_MAJOR = 5


@pytest.fixture(scope="module")
def kubectl() -> str:
    """kubectl's path; skipped without it, but failed under CI (which must provide it), and failed when too old."""
    path = shutil.which("kubectl")
    if path is None:
        reason = "kubectl is not installed (deploy/kubernetes needs kubectl 1.27 or later, for kustomize v5)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must provide it")
        pytest.skip(reason)
    reply = subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    version = json.loads(reply.stdout or "{}")
    kustomize = str(version.get("kustomizeVersion", "none"))
    major = re.match(r"v(\d+)\.", kustomize)
    if major is None or int(major.group(1)) < KUSTOMIZE_MAJOR:
        client = version.get("clientVersion", {}).get("gitVersion", "?")
        pytest.fail(f"kubectl {client} embeds kustomize {kustomize}; deploy/kubernetes needs v{KUSTOMIZE_MAJOR}")
    return path


@pytest.fixture(scope="module")
def rendered(kubectl: str) -> dict[Path, list[Resource]]:
    """The objects `kubectl kustomize` makes of the base, the example job and the overlay."""
    out: dict[Path, list[Resource]] = {}
    for directory in (BASE, EXAMPLES, OVERLAY):
        result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
        assert 0 == result.returncode, result.stderr
        out[directory] = documents_of(result.stdout)
    return out


def _configmap(resources: list[Resource], prefix: str) -> Resource:
    (found,) = [r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"].startswith(prefix)]
    return found


def test_base_renders_every_object_into_the_torchpulse_namespace(rendered: dict[Path, list[Resource]]) -> None:
    """The base makes its eight objects, each namespaced one in `torchpulse`."""
    resources = rendered[BASE]
    names = sorted(
        (r["kind"], r["metadata"]["name"].rsplit("-", 1)[0] if r["kind"] == "ConfigMap" else "") for r in resources
    )

    assert [
        ("ConfigMap", "torchpulse"),
        ("ConfigMap", "torchpulse-config"),
        ("DaemonSet", ""),
        ("Namespace", ""),
        ("PodMonitor", ""),
        ("PrometheusRule", ""),
        ("ServiceAccount", ""),
    ] == names
    assert ["torchpulse"] * 6 == [r["metadata"]["namespace"] for r in resources if r["kind"] != "Namespace"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("directory", [BASE, EXAMPLES, OVERLAY], ids=["base", "example", "overlay"])
def test_rendered_built_in_objects_validate_strictly(
    rendered: dict[Path, list[Resource]], directory: Path, version: str
) -> None:
    """Every built-in object kustomize renders fits the Kubernetes schema, unknown fields refused."""
    built_in = [resource for resource in rendered[directory] if resource["apiVersion"] != OPERATOR_API]

    errors = [error for resource in built_in for error in strict_validation_errors(resource, version)]

    assert [] != built_in
    assert [] == errors


def test_rendered_daemonset_is_hardened_and_runs_its_config(rendered: dict[Path, list[Resource]]) -> None:
    """The rendered DaemonSet keeps its hardening, runs the image's tag and mounts the config ConfigMap it fits."""
    resources = rendered[BASE]
    workload = one(resources, "DaemonSet")
    config = _configmap(resources, "torchpulse-config-")
    (config_volume,) = [volume for volume in pod_spec(workload)["volumes"] if volume["name"] == "config"]
    security = effective_security(workload, "daemon")

    assert HARDENED_CONTAINER == {key: security[key] for key in HARDENED_CONTAINER}
    assert DAEMON_CONFIG.read_text() == config["data"]["torchpulse.toml"]
    assert config["metadata"]["name"] == config_volume["configMap"]["name"]
    assert [] == config_disagreements(workload, config["data"]["torchpulse.toml"])
    assert [f"torchpulse:{project_version()}"] * 2 == [
        container(workload, "daemon")["image"],
        container(workload, "host-directories", init=True)["image"],
    ]


def test_rendered_rules_and_dashboard_are_the_dashboards_files(rendered: dict[Path, list[Resource]]) -> None:
    """The PrometheusRule's groups are the rules file's, and the labelled ConfigMap holds the dashboard file."""
    resources = rendered[BASE]
    rule = one(resources, "PrometheusRule")
    dashboard = _configmap(resources, "torchpulse-dashboard")

    assert yaml.safe_load(RULES.read_text())["groups"] == rule["spec"]["groups"]
    assert DASHBOARD.read_text() == dashboard["data"]["torchpulse.json"]
    assert ("torchpulse-dashboard", "1") == (
        dashboard["metadata"]["name"],
        dashboard["metadata"]["labels"]["grafana_dashboard"],
    )


def test_overlay_adds_a_root_its_image_and_the_prometheus_label(rendered: dict[Path, list[Resource]]) -> None:
    """The overlay's config, mounts and probe agree, its image is used, and both CRs carry Prometheus' label."""
    resources = rendered[OVERLAY]
    workload = one(resources, "DaemonSet")
    config = _configmap(resources, "torchpulse-config-")["data"]["torchpulse.toml"]

    assert [] == config_disagreements(workload, config)
    assert f"registry.example.com/ml-platform/torchpulse:{project_version()}" == container(workload, "daemon")["image"]
    assert ["monitoring", "monitoring"] == [
        one(resources, kind)["metadata"]["labels"]["release"] for kind in ("PodMonitor", "PrometheusRule")
    ]
    assert '"/mnt/nfs/checkpoints"' in config
