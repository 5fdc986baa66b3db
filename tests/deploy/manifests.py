"""Readers for deploy/: the kustomize base, its generated copies, the example job and the Containerfile."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from decimal import Decimal
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "kubernetes"
EXAMPLES = REPO / "deploy" / "examples"
EXAMPLE_JOB = EXAMPLES / "training-job.yaml"
OVERLAY = EXAMPLES / "overlay"
DAEMON_CONFIG = BASE / "torchpulse.toml"
CONTAINERFILE = REPO / "deploy" / "Containerfile"
DOC = REPO / "docs" / "kubernetes.md"
RULES = REPO / "dashboards" / "prometheus" / "torchpulse.rules.yml"
DASHBOARD = REPO / "dashboards" / "grafana" / "torchpulse.json"
CONTRACT = REPO / "dashboards" / "metrics.txt"

# The oldest Kubernetes the base is written for (the pod label batch.kubernetes.io/job-name the example
# reads came in 1.27) and the newest whose schemas kubernetes-validate ships.
OLDEST_KUBERNETES = "1.27"
KUBERNETES_VERSIONS = (OLDEST_KUBERNETES, kubernetes_validate.latest_version())
# prometheus-operator's kinds: no schema of theirs ships with kubernetes-validate.
OPERATOR_API = "monitoring.coreos.com/v1"

Resource = dict[str, Any]


def documents(path: Path) -> list[Resource]:
    """Every non-empty YAML document of `path`."""
    return documents_of(path.read_text())


def documents_of(text: str) -> list[Resource]:
    return [document for document in yaml.safe_load_all(text) if document]


def kustomization(directory: Path = BASE) -> Resource:
    loaded: Resource = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return loaded


def base_resources() -> list[Resource]:
    """The resources the base lists (generated ConfigMaps excluded: only kustomize makes those)."""
    return [resource for name in kustomization()["resources"] for resource in documents(BASE / name)]


def one(resources: list[Resource], kind: str) -> Resource:
    """The single resource of `kind`."""
    found = [resource for resource in resources if resource["kind"] == kind]
    assert len(found) == 1, f"{len(found)} resources of kind {kind}"
    return found[0]


def daemonset() -> Resource:
    return one(base_resources(), "DaemonSet")


def pod_spec(workload: Resource) -> Resource:
    spec: Resource = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Resource, name: str, init: bool = False) -> Resource:
    containers = pod_spec(workload)["initContainers" if init else "containers"]
    return next(entry for entry in containers if entry["name"] == name)


# The daemon container's settings that the issue and the systemd unit's hardening ask for.
HARDENED_CONTAINER = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "privileged": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def effective_security(workload: Resource, name: str) -> dict[str, Any]:
    """A container's security settings as the kubelet applies them: its own, else the pod's."""
    pod = pod_spec(workload).get("securityContext", {})
    own = container(workload, name).get("securityContext", {})
    keys = {*HARDENED_CONTAINER, "runAsUser", "runAsGroup"}
    return {key: own[key] if key in own else pod.get(key) for key in keys}


def hostpath_mounts(workload: Resource, entry: Resource) -> dict[str, tuple[str, bool]]:
    """mountPath -> (host path, read-only) for each hostPath volume `entry` mounts."""
    volumes = {volume["name"]: volume for volume in pod_spec(workload)["volumes"]}
    return {
        mount["mountPath"]: (volumes[mount["name"]]["hostPath"]["path"], bool(mount.get("readOnly", False)))
        for mount in entry.get("volumeMounts", [])
        if "hostPath" in volumes[mount["name"]]
    }


def daemon_config(text: str | None = None) -> Any:
    """A daemon config file (deploy/kubernetes/torchpulse.toml by default) read by the daemon's own parser."""
    from torchpulse.daemon.config import from_mapping

    return from_mapping(tomllib.loads(DAEMON_CONFIG.read_text() if text is None else text))


def checkpoints_config(text: str | None = None) -> Any:
    from torchpulse.daemon.checkpoints.config import parse

    return parse(daemon_config(text).extra.get("checkpoints", {}))


def config_disagreements(workload: Resource, config_text: str) -> list[str]:
    """Where the daemon's config file and the DaemonSet that runs it do not fit together; [] when they do.

    The socket's directory and the state directory must be writable hostPath mounts at the host's own
    path (training pods mount the same host directory); each checkpoint root a read-only hostPath mount
    at its host path (jobs announce the paths they see); no other host directory mounted; the probe,
    `TORCHPULSE_SOCKET` and the port naming the configured socket and listen port.
    """
    from torchpulse.daemon.config import parse_listen

    config = daemon_config(config_text).daemon
    roots = {root.path for root in checkpoints_config(config_text).roots}
    daemon = container(workload, "daemon")
    mounts = hostpath_mounts(workload, daemon)
    shared = {
        entry["mountPath"] for entry in daemon["volumeMounts"] if entry.get("mountPropagation") == "HostToContainer"
    }
    wanted = {str(config.socket.parent): False, str(config.state_dir): False} | dict.fromkeys(roots, True)
    problems = [
        f"{path} is not mounted {'read-only' if read_only else 'writable'} from the host's {path}"
        for path, read_only in wanted.items()
        if mounts.get(path) != (path, read_only)
    ]
    problems += [f"{host} at {path} is in no config key" for path, (host, _) in mounts.items() if path not in wanted]
    problems += [f"root {root} misses later host mounts (mountPropagation)" for root in roots - shared]
    if daemon["readinessProbe"]["exec"]["command"][-2:] != ["--socket", str(config.socket)]:
        problems.append("the readiness probe asks another socket than daemon.socket")
    if {"name": "TORCHPULSE_SOCKET", "value": str(config.socket)} not in daemon.get("env", []):
        problems.append("TORCHPULSE_SOCKET is not daemon.socket")
    metrics_ports = [port["containerPort"] for port in daemon["ports"] if port["name"] == "metrics"]
    if metrics_ports != [parse_listen(config.listen)[1]]:
        problems.append("the metrics port is not the port of daemon.listen")
    return problems


def strict_validation_errors(resource: Resource, version: str) -> list[str]:
    """What the Kubernetes `version` schema (unknown fields refused) finds wrong with `resource`."""
    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(part) for part in exc.path)
        return [f"{resource['kind']}/{resource['metadata']['name']} at {where or '.'}: {exc.message}"]
    return []


_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL_SUFFIXES = {
    "m": Decimal("0.001"),
    "": Decimal(1),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
}


def quantity(value: str | int) -> Decimal:
    """A Kubernetes resource quantity ("6Gi", "250m", "2") as a number of bytes or cores."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert match is not None, value
    number, suffix = Decimal(match.group(1)), match.group(2)
    if suffix in _BINARY_SUFFIXES:
        return number * _BINARY_SUFFIXES[suffix]
    return number * _DECIMAL_SUFFIXES[suffix]


# prometheus-operator's Duration (the pattern its CRDs put on interval, scrapeTimeout and `for`).
OPERATOR_DURATION = re.compile(
    r"(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)"
)
_UNITS = {"y": 365 * 86400, "w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_UNIT_SECONDS = {unit: Decimal(value) for unit, value in _UNITS.items()} | {"ms": Decimal("0.001")}


def seconds(duration: str) -> Decimal:
    """A Prometheus duration ("15s", "1m30s") in seconds."""
    assert OPERATOR_DURATION.fullmatch(duration), duration
    return sum(
        (Decimal(n) * _UNIT_SECONDS[unit] for n, unit in re.findall(r"([0-9]+)(ms|[ywdhms])", duration)), Decimal(0)
    )


def contract_labels() -> set[str]:
    """Every label name a family of dashboards/metrics.txt carries."""
    labels: set[str] = set()
    for line in CONTRACT.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) > 2:
            labels.update(fields[2].split(","))
    return labels


def generator() -> ModuleType:
    """deploy/kubernetes/generate.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("torchpulse_deploy_generate", BASE / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def project_version() -> str:
    version: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return version


def containerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Containerfile, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in CONTAINERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        pending += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            keyword, _, arguments = pending.strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
            pending = ""
    return instructions


def yaml_blocks(markdown: str) -> list[str]:
    """The bodies of the ```yaml blocks of a Markdown text."""
    return re.findall(r"^```yaml\n(.*?)^```$", markdown, re.MULTILINE | re.DOTALL)
