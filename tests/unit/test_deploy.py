"""Syntax and shape of deploy/: Kubernetes manifests (YAML) and systemd units (INI)."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
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
    claim_names = [v["persistentVolumeClaim"]["claimName"] for v in volumes.values() if "persistentVolumeClaim" in v]
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


@pytest.mark.parametrize(
    "name,subcommand",
    [
        ("loraplane-control-plane.service", "control-plane"),
        ("loraplane-worker@.service", "worker"),
    ],
)
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

    from clients.cli.main import cli

    for name in ("loraplane-control-plane.service", "loraplane-worker@.service"):
        argv = shlex.split(parse_unit(name)["Service"]["ExecStart"])
        help_text = CliRunner().invoke(cli, [argv[1], "--help"]).output
        for arg in argv[2:]:
            if arg.startswith("--"):
                assert arg in help_text, (name, arg)


# ---- systemd: optional flags from the environment files ----------------------------------

NAME = r"[A-Za-z_][A-Za-z0-9_]*"


def env_file(path: Path) -> dict[str, str]:
    """An EnvironmentFile's assignments (systemd.exec(5): ``KEY=VALUE`` lines, ``#``/``;``
    comments and blank lines skipped, a value in matching quotes unquoted)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(NAME, key.strip()), (path.name, line)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def expand_exec(cmdline: str, env: dict[str, str]) -> list[str]:
    """An ExecStart= line as systemd runs it (systemd.service(5), "Command lines"): ``${VAR}``
    becomes its value as exactly one word; ``$VAR`` as a word of its own becomes the value split
    at whitespace, zero or more words (an empty or unset variable: none)."""
    argv = []
    for word in shlex.split(cmdline):
        whole = re.fullmatch(rf"\$({NAME})", word)
        if whole:
            argv += env.get(whole[1], "").split()
        else:
            argv.append(re.sub(rf"\$\{{({NAME})\}}", lambda m: env.get(m[1], ""), word))
    return argv


def unit_lines(name: str, key: str) -> list[str]:
    """Every value of ``key=`` in the unit's [Service] section, in order (repeatable keys)."""
    return [
        line.split("=", 1)[1].strip()
        for line in (SYSTEMD / name).read_text().splitlines()
        if line.startswith(f"{key}=")
    ]


def parse_flags(subcommand: str, args: list[str]) -> dict:
    """``args`` through click's own parser for ``loraplane SUBCOMMAND`` (no conversion, no
    side effects): option name → raw value. Raises click's NoSuchOption for a flag it lacks."""
    import click

    from clients.cli.main import cli

    cmd = cli.commands[subcommand]
    opts, _, _ = cmd.make_parser(click.Context(cmd, info_name=subcommand)).parse_args(args)
    return opts


@pytest.mark.parametrize(
    "name,instance,expected",
    [
        (
            "loraplane-control-plane.service",
            "",
            {"http_addr": "0.0.0.0:8000", "metrics_addr": "0.0.0.0:9400", "addr": "0.0.0.0:50051"},
        ),
        ("loraplane-worker@.service", "0", {"max_loras": "8", "max_cpu_loras": "64", "metrics_addr": "0.0.0.0:9401"}),
    ],
)
def test_units_take_optional_flags_from_their_environment_files(name, instance, expected):
    """The example environment files shipped next to the units turn on HTTP and metrics: with
    them the ExecStart line expands (as systemd does) to flags the CLI parses to those values;
    without them the optional-flag variables expand to no argument at all."""
    (env_line,) = unit_lines(name, "Environment")
    defaults = dict(kv.split("=", 1) for kv in shlex.split(env_line.replace("%i", instance)))
    (exec_start,) = unit_lines(name, "ExecStart")
    exec_start = exec_start.replace("%i", instance).replace("%H", "host")
    bare = expand_exec(exec_start, defaults)
    assert "" not in bare and not any("$" in a for a in bare), bare
    env = dict(defaults)
    for path in unit_lines(name, "EnvironmentFile"):
        example = SYSTEMD / (Path(path.lstrip("-").replace("%i", instance)).name + ".example")
        assert example.exists(), example  # every environment file the unit reads has an example
        env.update(env_file(example))
    argv = expand_exec(exec_start, env)
    assert argv[:2] == bare[:2] and len(argv) > len(bare)
    flags = parse_flags(argv[1], argv[2:])
    assert {k: flags.get(k) for k in expected} == expected
    parse_flags(bare[1], bare[2:])  # the defaults alone parse too


def test_units_pass_systemd_analyze_verify(tmp_path):
    """``systemd-analyze verify`` accepts both units (the worker as instance 0), with ExecStart
    pointed at this environment's ``loraplane`` (verify checks the binary exists)."""
    import shutil
    import subprocess
    import sys

    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    script = Path(sys.executable).with_name("loraplane")
    if not script.exists():
        pytest.skip("the loraplane console script is not installed (pip install -e .)")
    for name, target in (
        ("loraplane-control-plane.service", "loraplane-control-plane.service"),
        ("loraplane-worker@.service", "loraplane-worker@0.service"),
    ):
        text = (SYSTEMD / name).read_text().replace("/opt/loraplane/venv/bin/loraplane", str(script))
        (tmp_path / target).write_text(text)
        proc = subprocess.run([tool, "verify", str(tmp_path / target)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "loraplane" not in proc.stderr, (target, proc.stderr)


def test_manifest_options_match_the_cli():
    from click.testing import CliRunner

    from clients.cli.main import cli

    for name, kind in (("control-plane.yaml", "Deployment"), ("workers.yaml", "StatefulSet")):
        (workload,) = by_kind(load_all(name))[kind]
        args = only_container(workload)["args"]
        help_text = CliRunner().invoke(cli, [args[0], "--help"]).output
        for arg in args[1:]:
            if arg.startswith("--"):
                assert arg in help_text, (name, arg)


# ---- the image and the PostgreSQL variant ------------------------------------------------

ROOT = DEPLOY.parent
DOCKERFILE = DEPLOY / "Dockerfile"
PG_DIR = K8S / "postgres"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]`` with continuation lines joined and comments dropped."""
    joined, out = "", []
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not joined:
            continue
        joined += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if joined.strip():
                word, _, rest = joined.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            joined = ""
    return out


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """``{stage name: its instructions}`` in order (``FROM image AS name`` opens a stage)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            image, _, name = rest.partition(" AS ")
            current = stages[name.strip()] = [(word, image.strip())]
        elif current is not None:
            current.append((word, rest))
    return stages


def dockerfile_args() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in dockerfile_instructions() if word == "ARG" and "=" in rest)


def all_workloads() -> list[tuple[str, dict]]:
    files = ["control-plane.yaml", "workers.yaml", "postgres/control-plane.yaml"]
    return [(f, d) for f in files for d in load_all(f) if d["kind"] in ("Deployment", "StatefulSet")]


def test_dockerfile_base_image_is_pinned():
    froms = [rest for word, rest in dockerfile_instructions() if word == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE} AS runtime"]
    image = dockerfile_args()["BASE_IMAGE"]
    name, _, tag = image.partition(":")
    assert name == "python" and tag and tag != "latest"
    assert re.fullmatch(r"3\.11\.\d+-slim-bookworm", tag), tag  # a patch release, a fixed distro


def test_dockerfile_installs_pinned_torch_from_pytorch_index_before_the_project():
    import tomllib

    pins = [
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("torch")
    ]
    args = dockerfile_args()
    assert pins == [f"torch=={args['TORCH_VERSION']}"]
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"  # CPU image by default
    runs = [rest for word, rest in dockerfile_stages()["runtime"] if word == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_at]
    project_at = next(i for i, r in enumerate(runs) if "pip install /tmp/wheels/loraplane-*.whl" in r)
    assert torch_at < project_at


COMPILER = re.compile(r"(?<![\w+-])(g\+\+|gcc|c\+\+|clang|build-essential)(?![\w+-])")


def test_dockerfile_builds_the_kernels_in_a_build_stage_and_runs_them_without_a_compiler():
    """The build stage has a compiler and builds the wheel from the sources (setup.py compiles
    the kernels into it); the runtime stage copies only that wheel, installs no compiler, runs as
    the non-root user, and smoke-checks the prebuilt kernels and the CLI in its own layout."""
    stages = dockerfile_stages()
    assert list(stages) == ["build", "runtime"]  # the last stage is the image
    build, runtime = stages["build"], stages["runtime"]
    build_runs = " ".join(rest for word, rest in build if word == "RUN")
    assert "apt-get install -y --no-install-recommends g++" in build_runs
    copied = {src for word, rest in build if word == "COPY" for src in rest.split()[:-1]}
    assert {"pyproject.toml", "setup.py", "control_plane", "worker", "clients", "loraplane"} <= copied
    assert "pip wheel --no-deps --no-build-isolation -w /wheels ." in build_runs
    assert [rest for word, rest in runtime if word == "COPY"] == ["--from=build /wheels /tmp/wheels"]
    commands = [c.strip() for word, rest in runtime if word == "RUN" for c in rest.split("&&")]
    assert [c for c in commands if COMPILER.search(c) and not c.startswith("! command -v")] == []
    assert not any("apt-get" in c for c in commands)
    words = [word for word, _ in runtime]
    assert runtime[words.index("USER")][1] == "10001:10001"
    smoke = runtime[words.index("RUN", words.index("USER"))][1]  # the first RUN as that user
    for want in (
        "! command -v g++",
        "! command -v gcc",
        "python -m worker.runtime.kernels",
        "loraplane --help",
    ):
        assert want in smoke, (want, smoke)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"worker/runtime/kernels/_build", "build"} <= set(ignored)  # the host's libraries stay out


def test_dockerfile_user_ports_and_entrypoint_match_the_manifests():
    instr = dockerfile_instructions()
    (user,) = [rest for word, rest in instr if word == "USER"]
    assert re.search(r"--uid 10001 --gid 10001", " ".join(r for w, r in instr if w == "RUN"))
    for name, workload in all_workloads():
        ctx = workload["spec"]["template"]["spec"]["securityContext"]
        assert f"{ctx['runAsUser']}:{ctx['runAsGroup']}" == user, name
        assert ctx["runAsNonRoot"] is True
    (expose,) = [rest for word, rest in instr if word == "EXPOSE"]
    ports = {int(p) for p in expose.split()}
    for name, workload in all_workloads():
        c = only_container(workload)
        assert {p["containerPort"] for p in c["ports"]} <= ports, name
        assert c["command"] == ["loraplane"]
    (entry,) = [rest for word, rest in instr if word == "ENTRYPOINT"]
    assert entry == '["loraplane"]'
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_one_image_tag_everywhere():
    images = {only_container(w)["image"] for _, w in all_workloads()}
    assert images == {"loraplane:0.1.0"}
    assert "-t loraplane:0.1.0 " in DOCKERFILE.read_text()


def test_postgres_variant_rolls_with_replicas_and_reads_the_database_secret():
    from loraplane.env import ENV_DATABASE_URL

    kinds = by_kind(load_all("postgres/control-plane.yaml"))
    assert set(kinds) == {"Deployment", "Service", "PodDisruptionBudget"}  # no PVC: nothing local to keep
    (dep,) = kinds["Deployment"]
    assert dep["spec"]["replicas"] >= 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    c = only_container(dep)
    env = {e["name"]: e for e in c["env"]}
    ref = env[ENV_DATABASE_URL]["valueFrom"]["secretKeyRef"]
    assert "optional" not in ref  # no database, no start
    secret = yaml.safe_load((PG_DIR / "database-secret.example.yaml").read_text())
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", ref["name"])
    assert secret["stringData"][ref["key"]].startswith("postgresql://")
    assert "--database" not in c["args"]  # the URL (with its password) comes from the Secret
    assert_grpc_probes(c, CP_PORT)
    assert [p["containerPort"] for p in c["ports"]] == [CP_PORT, HTTP_PORT, METRICS_PORT]
    assert_scraped(dep, c, "--metrics-addr")
    volumes = dep["spec"]["template"]["spec"]["volumes"]
    assert all("persistentVolumeClaim" not in v for v in volumes)
    data_dir = c["args"][c["args"].index("--data-dir") + 1]
    assert data_dir in {m["mountPath"] for m in c["volumeMounts"]}
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1 and pdb["spec"]["selector"] == dep["spec"]["selector"]
    (svc,) = kinds["Service"]
    sqlite_svc = by_kind(load_all("control-plane.yaml"))["Service"][0]
    assert svc == sqlite_svc  # workers.yaml names the same Service in both variants
    kust = yaml.safe_load((PG_DIR / "kustomization.yaml").read_text())
    assert kust["resources"] == ["control-plane.yaml"]  # the Secret is never applied from the example
    from click.testing import CliRunner

    from clients.cli.main import cli

    help_text = CliRunner().invoke(cli, ["control-plane", "--help"]).output
    assert "--database" in help_text and ENV_DATABASE_URL in (ROOT / "deploy" / "README.md").read_text()
    for arg in c["args"][1:]:
        if arg.startswith("--"):
            assert arg in help_text, arg


def test_every_workload_shares_the_worker_secret_and_none_opens_the_door():
    """A control plane without a worker secret refuses workers (docs/security.md): every
    control plane and worker takes LORAPLANE_WORKER_SECRET from the same required Secret key,
    and no manifest or unit passes --insecure-workers."""
    from loraplane.env import ENV_WORKER_SECRET

    refs = set()
    for name, workload in all_workloads():
        c = only_container(workload)
        env = {e["name"]: e for e in c.get("env", [])}
        ref = env[ENV_WORKER_SECRET]["valueFrom"]["secretKeyRef"]
        assert not ref.get("optional", False), name
        refs.add((ref["name"], ref["key"]))
        assert "--insecure-workers" not in c.get("args", []), name
    assert refs == {("loraplane-worker-secret", "secret")}
    for unit in SYSTEMD.glob("*.service"):
        text = unit.read_text()
        assert "--insecure-workers" not in text and ENV_WORKER_SECRET in text, unit.name
    assert "loraplane-worker-secret" in (DEPLOY / "README.md").read_text()


def test_dockerfile_cmd_serves_every_port_it_exposes():
    """``docker run loraplane:0.1.0`` with no arguments is a control plane listening on every
    port the image EXPOSEs but the worker's: gRPC 50051, the HTTP API 8000 and /health +
    /metrics 9090 (flags parsed by the CLI's own parser); 50061 is what the worker manifest
    binds."""
    import json

    instr = dockerfile_instructions()
    (expose,) = [rest for word, rest in instr if word == "EXPOSE"]
    (cmd,) = [json.loads(rest) for word, rest in instr if word == "CMD"]
    assert cmd[0] == "control-plane"
    flags = parse_flags(cmd[0], cmd[1:])
    bound = {flags[k] for k in ("addr", "http_addr", "metrics_addr")}
    assert bound == {f"0.0.0.0:{CP_PORT}", f"0.0.0.0:{HTTP_PORT}", f"0.0.0.0:{METRICS_PORT}"}
    (workers,) = by_kind(load_all("workers.yaml"))["StatefulSet"]
    worker_args = only_container(workers)["args"]
    assert worker_args[worker_args.index("--addr") + 1] == f"0.0.0.0:{WORKER_PORT}"
    assert {int(p) for p in expose.split()} == {int(a.rpartition(":")[2]) for a in bound} | {WORKER_PORT}


def test_control_plane_unit_says_how_many_may_run():
    """One per host; one in all on SQLite, several on PostgreSQL (deploy/README.md's table)."""
    header = (SYSTEMD / "loraplane-control-plane.service").read_text().split("[Unit]")[0]
    assert "One per deployment" not in header
    assert "One per host" in header and "ONE host" in header and "several hosts" in header
    assert "LORAPLANE_DATABASE_URL" in header


# ---- the Grafana dashboard under deploy/k8s's scrape config --------------------------------

DASHBOARD = DEPLOY / "grafana" / "loraplane-dashboard.json"
SELECTOR = re.compile(r"\b(loraplane_[a-z0-9_]+|vllm:[a-z_]+)(\{[^}]*\})?")
POOL_GAUGES = (
    "loraplane_workers_live",
    "loraplane_pool_slots",
    "loraplane_adapters_registered",
    "loraplane_kv_cache_usage_perc",
    "loraplane_adapter_residency",
    "vllm:kv_cache_usage_perc",
)
"""Gauges every control-plane replica reports for the whole worker pool: never summed over
replicas (deploy/k8s/postgres runs two, each scraped)."""


def dashboard_exprs() -> list[str]:
    import json

    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_dashboard_filters_every_query_by_the_job_variable():
    import json

    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    job = variables["job"]
    assert job["type"] == "query" and job["multi"] and job["includeAll"]
    assert job["query"]["query"] == 'label_values({__name__=~"loraplane_.+"}, job)'
    exprs = dashboard_exprs()
    selectors = [m for e in exprs for m in SELECTOR.finditer(e)]
    assert len(selectors) >= len(exprs) > 30
    for m in selectors:
        assert m.group(2) and 'job=~"$job"' in m.group(2), m.group(0)


def test_dashboard_takes_pool_gauges_once_not_once_per_replica():
    """A pool-wide gauge goes through ``max`` (over the replicas that all report it) before any
    sum; ``vllm:kv_cache_usage_perc`` is the control plane's (``model_name``), not the workers'
    series of the same name."""
    for expr in dashboard_exprs():
        for name in POOL_GAUGES:
            for m in re.finditer(re.escape(name) + r"\{", expr):
                head = expr[: m.start()]
                assert re.search(r"max(?: by \([a-z, ]+\) )?\($", head), expr
    (kv,) = [e for e in dashboard_exprs() if "vllm:kv_cache_usage_perc" in e]
    assert 'model_name!=""' in kv
