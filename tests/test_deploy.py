"""Syntax and shape of deploy/: Kubernetes manifests (YAML) and systemd units (INI)."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
CP_PORT = 50051
WORKER_PORT = 50061


def load_all(name: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    assert docs, name
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
    return docs


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def only_container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def assert_grpc_probes(container: dict, port: int) -> None:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
        assert "exec" not in container[probe] and "httpGet" not in container[probe]


def test_every_manifest_parses():
    files = sorted(K8S.glob("*.yaml"))
    assert {f.name for f in files} >= {"control-plane.yaml", "workers.yaml"}
    for f in files:
        assert [d for d in yaml.safe_load_all(f.read_text()) if d is not None], f.name


def test_kustomization_lists_the_manifests():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    for resource in kust["resources"]:
        assert (K8S / resource).is_file()


HTTP_PORT = 8000
METRICS_PORT = 9090


def assert_scraped(workload: dict, container: dict, flag: str) -> None:
    """Prometheus scrape annotations point at a named container port the process serves on."""
    ann = workload["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(ann["prometheus.io/port"]) == ports["metrics"] == METRICS_PORT
    assert container["args"][container["args"].index(flag) + 1] == f"0.0.0.0:{METRICS_PORT}"


def test_control_plane_manifest():
    kinds = by_kind(load_all("control-plane.yaml"))
    assert set(kinds) == {"PersistentVolumeClaim", "Deployment", "Service"}
    (pvc,) = kinds["PersistentVolumeClaim"]
    (dep,) = kinds["Deployment"]
    (svc,) = kinds["Service"]
    # SQLite: one writer on a RWO volume.
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    claim_names = [v["persistentVolumeClaim"]["claimName"] for v in volumes.values()
                   if "persistentVolumeClaim" in v]
    assert claim_names == [pvc["metadata"]["name"]]
    c = only_container(dep)
    assert c["command"] == ["loraplane"] and c["args"][0] == "control-plane"
    assert f"0.0.0.0:{CP_PORT}" in c["args"]
    data_dir = c["args"][c["args"].index("--data-dir") + 1]
    assert data_dir in {m["mountPath"] for m in c["volumeMounts"]}
    assert [p["containerPort"] for p in c["ports"]] == [CP_PORT, HTTP_PORT, METRICS_PORT]
    assert_grpc_probes(c, CP_PORT)
    assert_scraped(dep, c, "--metrics-addr")
    assert c["args"][c["args"].index("--http-addr") + 1] == f"0.0.0.0:{HTTP_PORT}"
    assert [p["port"] for p in svc["spec"]["ports"]] == [CP_PORT, HTTP_PORT, METRICS_PORT]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == selector
    assert svc["spec"]["ports"][0]["port"] == CP_PORT


def test_workers_manifest():
    kinds = by_kind(load_all("workers.yaml"))
    assert set(kinds) == {"Service", "StatefulSet"}
    (svc,) = kinds["Service"]
    (sts,) = kinds["StatefulSet"]
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    c = only_container(sts)
    assert c["command"] == ["loraplane"] and c["args"][0] == "worker"
    cp_addr = c["args"][c["args"].index("--control-plane") + 1]
    cp_svc = by_kind(load_all("control-plane.yaml"))["Service"][0]["metadata"]["name"]
    assert cp_addr == f"{cp_svc}:{CP_PORT}"
    assert c["args"][c["args"].index("--device") + 1] == "cuda"
    assert sorted(p["containerPort"] for p in c["ports"]) == sorted([WORKER_PORT, METRICS_PORT])
    assert_grpc_probes(c, WORKER_PORT)
    assert_scraped(sts, c, "--metrics-addr")
    resources = c["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == 1
    assert resources["limits"]["nvidia.com/gpu"] == 1  # extended resources: equal if both set
    env = {e["name"] for e in c["env"]}
    assert {"POD_NAME", "POD_IP"} <= env


def parse_unit(name: str) -> configparser.ConfigParser:
    # systemd units are INI-like: '%' specifiers (no interpolation), repeated keys allowed.
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # keys are case-sensitive in systemd
    text = (SYSTEMD / name).read_text()
    parser.read_string(text)
    return parser


@pytest.mark.parametrize("name,subcommand", [
    ("loraplane-control-plane.service", "control-plane"),
    ("loraplane-worker@.service", "worker"),
])
def test_systemd_units(name, subcommand):
    unit = parse_unit(name)
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "loraplane"
    assert argv[1] == subcommand
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "LORAPLANE_ADMIN_TOKEN" not in service["ExecStart"]


def test_worker_unit_is_a_template_per_gpu():
    unit = parse_unit("loraplane-worker@.service")
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert "--control-plane" in argv
    assert "CUDA_VISIBLE_DEVICES=%i" in service["Environment"].split()
    assert "loraplane-control-plane.service" in unit["Unit"]["After"]


def test_unit_options_match_the_cli():
    """Every --flag a unit passes exists on that CLI command."""
    from click.testing import CliRunner

    from clients.cli import cli

    for name in ("loraplane-control-plane.service", "loraplane-worker@.service"):
        argv = shlex.split(parse_unit(name)["Service"]["ExecStart"])
        help_text = CliRunner().invoke(cli, [argv[1], "--help"]).output
        for arg in argv[2:]:
            if arg.startswith("--"):
                assert arg in help_text, (name, arg)


def test_manifest_options_match_the_cli():
    from click.testing import CliRunner

    from clients.cli import cli

    for name, kind in (("control-plane.yaml", "Deployment"), ("workers.yaml", "StatefulSet")):
        (workload,) = by_kind(load_all(name))[kind]
        args = only_container(workload)["args"]
        help_text = CliRunner().invoke(cli, [args[0], "--help"]).output
        for arg in args[1:]:
            if arg.startswith("--"):
                assert arg in help_text, (name, arg)
