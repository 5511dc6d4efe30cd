"""The Kubernetes example (``deploy/kubernetes/``): valid against the Kubernetes schemas, consistent with
the image and the server's CLI, and shown in ``docs/distributed.md`` exactly as the files hold it.

The schemas are the ones ``kubernetes-validate`` ships (JSON schemas of the API objects, one set per
Kubernetes minor release), read offline; strict mode refuses a field the schema does not know.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from envserver.cli import parse_config
from tests.deploy.containerfile import exec_form, healthcheck_command, only
from tests.doc_blocks import ROOT, blocks

MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
DOC = ROOT / "docs" / "distributed.md"
# The oldest minor release the example is meant for, and the newest the schemas cover.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())


def _objects(text: str) -> list[dict[str, Any]]:
    return [item for item in yaml.safe_load_all(text) if item]


def _by_kind() -> dict[str, dict[str, Any]]:
    found = {}
    for path in MANIFESTS:
        for item in _objects(path.read_text()):
            found[item["kind"]] = item
    return found


def _validate(item: dict[str, Any], version: str) -> None:
    """Raise ``ValidationError`` (or ``SchemaNotFoundError``) unless ``item`` is a valid object of its kind."""
    kubernetes_validate.validate(item, version, strict=True)


def test_there_is_a_deployment_and_a_service() -> None:
    assert {"Deployment", "Service"} <= set(_by_kind())


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    for item in _objects(path.read_text()):
        _validate(item, version)


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0]


def _misspell_a_field(d: dict[str, Any]) -> None:
    _container(d)["readinessProbe"]["periodSecond"] = 5


def _wrong_type(d: dict[str, Any]) -> None:
    d["spec"]["replicas"] = "three"


def _missing_required(d: dict[str, Any]) -> None:
    del d["spec"]["selector"]


def _probe_without_port(d: dict[str, Any]) -> None:
    _container(d)["livenessProbe"]["tcpSocket"] = {"host": "localhost"}


def _secret_without_key(d: dict[str, Any]) -> None:
    del _container(d)["env"][0]["valueFrom"]["secretKeyRef"]["key"]


@pytest.mark.parametrize("break_it", [_misspell_a_field, _wrong_type, _missing_required, _probe_without_port,
                                      _secret_without_key], ids=lambda f: f.__name__.strip("_"))
def test_a_broken_deployment_fails_validation(break_it: Any) -> None:
    broken = copy.deepcopy(_by_kind()["Deployment"])
    break_it(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken, KUBERNETES_VERSIONS[-1])


def test_an_unknown_kind_is_not_taken_as_valid() -> None:
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        _validate({"apiVersion": "v1", "kind": "Deploymnet", "metadata": {"name": "x"}}, KUBERNETES_VERSIONS[-1])


def test_the_service_selects_the_pods_on_their_named_port() -> None:
    deployment, service = _by_kind()["Deployment"], _by_kind()["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {port["name"]: port["containerPort"] for port in _container(deployment)["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports, f"targetPort {port['targetPort']} names no container port"
    assert service["spec"]["clusterIP"] == "None", "headless: the name must resolve to every ready pod"


def test_the_deployment_runs_the_image_as_built() -> None:
    deployment = _by_kind()["Deployment"]
    container = _container(deployment)
    assert deployment["spec"]["replicas"] >= 2
    exposed = int(only("EXPOSE").args.split("/")[0])
    assert [port["containerPort"] for port in container["ports"]] == [exposed]
    assert container["readinessProbe"]["exec"]["command"] == healthcheck_command()
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert str(pod_security["runAsUser"]) == only("USER").args.split(":")[0]
    assert pod_security["runAsNonRoot"] is True


def test_the_token_comes_from_a_secret_and_the_arguments_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    container = _container(_by_kind()["Deployment"])
    token = {item["name"]: item for item in container["env"]}["TOOLGYM_TOKEN"]
    assert set(token["valueFrom"]["secretKeyRef"]) == {"name", "key"}
    monkeypatch.setenv("TOOLGYM_TOKEN", "from-the-secret")
    _, config, _ = parse_config(exec_form(only("ENTRYPOINT").args)[3:] + container["args"])
    assert config.token == "from-the-secret"
    # The pod must outlive the server's drain on SIGTERM, or Kubernetes kills sessions mid-episode.
    assert _by_kind()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > \
        config.drain_timeout


def test_the_docs_show_every_manifest_as_the_files_hold_it() -> None:
    shown = {block.file: block.body for block in blocks(DOC) if block.lang == "yaml" and block.file}
    for path in MANIFESTS:
        name = path.relative_to(ROOT).as_posix()
        assert name in shown, f"docs/distributed.md does not show {name}"
        assert shown[name] == path.read_text(), f"docs/distributed.md's {name} differs from the file"
