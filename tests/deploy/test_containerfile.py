"""deploy/Containerfile read as text (no image is built here): its user, install and entry point fit the rest."""

from __future__ import annotations

import json
import re
import shlex
import tomllib

from tests.deploy.manifests import (
    REPO,
    container,
    containerfile_instructions,
    daemonset,
    kustomization,
    pod_spec,
    project_version,
)


def _stages() -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (the global ARGs before the first FROM left out)."""
    stages: list[list[tuple[str, str]]] = []
    for keyword, arguments in containerfile_instructions():
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, arguments))
    return stages


def _args(stage: list[tuple[str, str]]) -> dict[str, str]:
    return dict(arguments.partition("=")[::2] for keyword, arguments in stage if keyword == "ARG")


def test_both_stages_start_from_the_same_python() -> None:
    """The environment built in the first stage runs in the second: the same base image, the same Python path."""
    froms = [stage[0][1].split()[0] for stage in _stages()]
    (base_arg,) = [arguments for keyword, arguments in containerfile_instructions()[:1] if keyword == "ARG"]

    assert ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"] == froms
    assert base_arg.startswith("PYTHON_IMAGE=python:3.11")


def test_image_runs_as_the_daemonsets_user() -> None:
    """The final stage's USER is the numeric uid and gid the DaemonSet runs as, created as the torchpulse user."""
    final = _stages()[-1]
    security = pod_spec(daemonset())["securityContext"]
    expected = f"{security['runAsUser']}:{security['runAsGroup']}"
    (user,) = [arguments for keyword, arguments in final if keyword == "USER"]
    (create,) = [arguments for keyword, arguments in final if keyword == "RUN" and "useradd" in arguments]

    assert expected == user
    assert "0" != user.split(":")[0]
    assert f"--gid {security['runAsGroup']} torchpulse" in create
    assert f"--uid {security['runAsUser']} --gid {security['runAsGroup']}" in create


def test_image_installs_the_makefiles_torch_pin_before_the_project() -> None:
    """torch is the Makefile's TORCH_PIN from the CPU index, installed before the project, as in the README."""
    build = _stages()[0]
    makefile_pin = re.search(r"^TORCH_PIN \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    runs = [arguments for keyword, arguments in build if keyword == "RUN"]
    torch_install = next(index for index, run in enumerate(runs) if '"${TORCH_PIN}"' in run)
    project_install = next(index for index, run in enumerate(runs) if '"/src${EXTRAS}"' in run)

    assert makefile_pin is not None
    assert makefile_pin.group(1) == _args(build)["TORCH_PIN"]
    assert _args(build)["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert '--index-url "${TORCH_INDEX_URL}" "${TORCH_PIN}"' in runs[torch_install]
    assert torch_install < project_install


def test_image_build_fails_without_the_c_modules() -> None:
    """The build imports torch and every C extension of pyproject.toml after the install: no compiler, no image."""
    extensions = [
        module["name"]
        for module in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]
    ]
    (check,) = [arguments for keyword, arguments in _stages()[0] if keyword == "RUN" and "python -c" in arguments]
    imported = shlex.split(check.split("python -c", 1)[1])[0].removeprefix("import ").split(", ")

    assert ["torch", *extensions] == imported


def test_image_copies_everything_the_install_reads() -> None:
    """COPY brings pyproject.toml, its readme and the package (the C sources with it), and each source exists."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    copies = [shlex.split(arguments) for keyword, arguments in _stages()[0] if keyword == "COPY"]
    sources = [source for copy in copies for source in copy[:-1]]
    c_sources = [source for module in pyproject["tool"]["setuptools"]["ext-modules"] for source in module["sources"]]

    assert ["pyproject.toml", pyproject["project"]["readme"], "torchpulse"] == sources
    assert [] == [source for source in sources if not (REPO / source).exists()]
    assert all(source.startswith("torchpulse/") for source in c_sources)


def test_image_entry_point_is_the_daemonsets_command() -> None:
    """ENTRYPOINT and CMD are the DaemonSet's command, the port its metrics port, the tag the project's version."""
    final = _stages()[-1]
    daemon = container(daemonset(), "daemon")
    found = {keyword: arguments for keyword, arguments in final if keyword in ("ENTRYPOINT", "CMD", "EXPOSE")}
    (image,) = kustomization()["images"]

    assert daemon["command"] == json.loads(found["ENTRYPOINT"]) + json.loads(found["CMD"])
    assert daemon["ports"][0]["containerPort"] == int(found["EXPOSE"])
    assert ("torchpulse", project_version()) == (image["name"], image["newTag"])
    assert "torchpulse" == daemon["image"]
