"""The deploy files (deploy/Dockerfile, deploy/compose.yaml, deploy/k8s/) as CI can check them
without a Docker engine or a cluster: the Compose file against the Compose specification's
schema, both Kubernetes overlays rendered by ``kubectl kustomize`` and validated against the
Kubernetes schemas, and no environment variable in them that the code does not read."""

from __future__ import annotations

import copy
import json
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvservice.protocol.environment import VARIABLES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.32.0"
# Read by the libraries and images we run, not by our code.
THIRD_PARTY_VARIABLES = {"DJANGO_SETTINGS_MODULE", "PYTHONUNBUFFERED", "PATH", "HOME"}


def variables_the_code_reads() -> set[str]:
    """Every variable the code reads: the registry declares each one, and its own tests check
    that nothing reads the environment past it (tests/kvservice/test_environment.py)."""
    return set(VARIABLES)


def test_the_registry_holds_variables_of_each_reader() -> None:
    """The web app's, the worker's, the store's and Celery's variables alike."""
    names = variables_the_code_reads()
    assert {"SECRET_KEY", "INFERENCE_CONCURRENCY", "KV_S3_BUCKET", "WORKER_NICE"} <= names
    assert "NOT_A_SETTING_ANYWHERE" not in names


# --------------------------------------------------------------------------------------------
# Compose


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _check_compose(path: Path) -> subprocess.CompletedProcess:
    command = [
        str(Path(sys.executable).parent / "check-jsonschema"),
        "--builtin-schema",
        "vendor.compose-spec",
        str(path),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    result = _check_compose(DEPLOY / "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_compose_file_fails_the_check(tmp_path) -> None:
    broken = _compose()
    broken["services"]["web"]["depends_on"]["migrate"]["condition"] = "service_finished"
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = _check_compose(path)
    assert result.returncode != 0 and "service_finished" in result.stdout + result.stderr


def _app_services(compose: dict) -> dict[str, dict]:
    return {
        name: service
        for name, service in compose["services"].items()
        if str(service.get("image", "")).startswith("${RAGBLEND")
    }


def test_compose_runs_every_role_from_the_one_image_after_the_migrations() -> None:
    compose = _compose()
    services = _app_services(compose)
    assert set(services) == {"migrate", "web", "ingest", "beat", "inference", "inference-gpu"}
    for name, service in services.items():
        if name != "migrate":
            assert service["depends_on"] == {
                "migrate": {"condition": "service_completed_successfully"}
            }
    for backing in ("postgres", "minio", "valkey"):
        assert compose["services"]["migrate"]["depends_on"][backing] == {
            "condition": "service_healthy"
        }
        assert "healthcheck" in compose["services"][backing]
    # Every piece of state in a named volume; ports on the loopback interface only.
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"], (name, volume)
    gpu = services["inference-gpu"]
    assert gpu["profiles"] == ["gpu"] and services["inference"]["profiles"] == ["cpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_compose_sets_only_variables_the_code_reads() -> None:
    read = variables_the_code_reads() | THIRD_PARTY_VARIABLES
    for name, service in _app_services(_compose()).items():
        unknown = set(service.get("environment", {})) - read
        assert not unknown, f"{name} sets {sorted(unknown)}, which no code reads"


def test_env_example_lists_every_variable_compose_needs_and_nothing_else() -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    needed = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", text))
    example = {
        line.split("=", 1)[0]
        for line in (DEPLOY / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert needed <= example, sorted(needed - example)
    assert example - needed <= {"COMPOSE_PROFILES"}, sorted(example - needed)


# --------------------------------------------------------------------------------------------
# Kubernetes


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the Kubernetes overlays cannot be rendered here")
    return kubectl


def _render(overlay: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    result = _render(DEPLOY / "k8s" / "overlays" / request.param)
    assert result.returncode == 0, result.stderr
    return request.param, [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_overlays_are_valid_kubernetes_objects(rendered) -> None:
    import kubernetes_validate

    _, documents = rendered
    checked = 0
    for document in documents:
        if document["apiVersion"].startswith("keda.sh/"):
            continue  # a custom resource: no schema in kubernetes-validate; see the next test
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked >= 10


def test_a_broken_manifest_fails_validation(rendered) -> None:
    import kubernetes_validate

    _, documents = rendered
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "web"}]
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    for broken in (wrong_type, misspelt):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_a_kustomization_that_does_not_render_is_caught(tmp_path) -> None:
    shutil.copytree(DEPLOY / "k8s", tmp_path / "k8s")
    (tmp_path / "k8s" / "base" / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    assert _render(tmp_path / "k8s" / "overlays" / "cpu").returncode != 0


def _by_kind(documents: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _command(workload: dict) -> str:
    container = _container(workload)
    return " ".join(container.get("command", []) + container.get("args", []))


def test_each_role_runs_as_a_deployment_of_the_one_image(rendered) -> None:
    overlay, documents = rendered
    deployments = list(_by_kind(documents, "Deployment").values())
    for deployment in deployments:
        container = _container(deployment)
        assert container["image"] == f"ragblend:{'cuda' if overlay == 'gpu' else 'cpu'}"
        assert container["resources"]["requests"], deployment["metadata"]["name"]
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]
    joined = "\n".join(_command(d) for d in deployments)
    roles = ("webapp.asgi:application", "-Q answers,ingest,kv", "beat", "kvservice.worker")
    for role in roles:
        assert role in joined, role
    beats = [d for d in deployments if "worker beat" in _command(d)]
    assert len(beats) == 1 and beats[0]["spec"]["replicas"] == 1  # exactly one beat
    assert beats[0]["spec"]["strategy"]["type"] == "Recreate"  # never two during a rollout
    (job,) = _by_kind(documents, "Job").values()
    assert "manage.py migrate" in _command(job) and "ensure_buckets" in _command(job)
    (inference,) = [d for d in deployments if "kvservice.worker" in _command(d)]
    limits = _container(inference)["resources"].get("limits", {})
    assert ("nvidia.com/gpu" in limits) == (overlay == "gpu")


def test_web_is_probed_scaled_and_protected(rendered) -> None:
    _, documents = rendered
    (web,) = [d for d in _by_kind(documents, "Deployment").values() if "webapp.asgi" in _command(d)]
    container = _container(web)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    (hpa,) = _by_kind(documents, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == web["metadata"]["name"]
    budgets = {
        d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component")
        for d in _by_kind(documents, "PodDisruptionBudget").values()
    }
    assert {"web", "ingest", "inference"} <= budgets
    assert _by_kind(documents, "Ingress") and _by_kind(documents, "Service")


def _refuses_proxy_headers(command: str) -> bool:
    """uvicorn run so that no client can name its own address: ``--no-proxy-headers`` and no
    list of trusted forwarders (the app reads X-Forwarded-For per TRUSTED_PROXY_COUNT)."""
    return "--no-proxy-headers" in command and "--forwarded-allow-ips" not in command


def test_every_web_server_ignores_proxy_headers(rendered) -> None:
    from deploy.devstack import web_server_argv

    _, documents = rendered
    (web,) = [d for d in _by_kind(documents, "Deployment").values() if "webapp.asgi" in _command(d)]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    image_command = dockerfile[dockerfile.rindex("CMD [") :]
    compose_command = " ".join(_compose()["services"]["web"]["command"])
    dev_command = " ".join(web_server_argv(8000))
    for where, command in [
        ("Kubernetes", _command(web)),
        ("image", image_command),
        ("Compose", compose_command),
        ("dev", dev_command),
    ]:
        assert _refuses_proxy_headers(command), (where, command)
    assert not _refuses_proxy_headers("uvicorn app --proxy-headers --forwarded-allow-ips *")
    config = _by_kind(documents, "ConfigMap")
    assert any(c["data"].get("TRUSTED_PROXY_COUNT") == "1" for c in config.values())


def test_ingest_workers_scale_on_the_celery_queue(rendered) -> None:
    _, documents = rendered
    (scaled,) = _by_kind(documents, "ScaledObject").values()
    target = scaled["spec"]["scaleTargetRef"]["name"]
    assert target in _by_kind(documents, "Deployment")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis" and trigger["metadata"]["listName"] == "ingest"
    auth = trigger["authenticationRef"]["name"]
    assert auth in _by_kind(documents, "TriggerAuthentication")


def test_manifests_set_only_variables_the_code_reads(rendered) -> None:
    _, documents = rendered
    read = variables_the_code_reads() | THIRD_PARTY_VARIABLES
    set_here: set[str] = set()
    for config in _by_kind(documents, "ConfigMap").values():
        set_here |= set(config.get("data", {}))
    for document in documents:
        template = document.get("spec", {}).get("template", {}).get("spec", {})
        for container in template.get("containers", []):
            set_here |= {variable["name"] for variable in container.get("env", [])}
    assert set_here, "no environment found in the manifests"
    assert not set_here - read, f"set but read by no code: {sorted(set_here - read)}"


# --------------------------------------------------------------------------------------------
# Private files: every role writes under umask 077


def _image_entrypoint() -> list[str]:
    dockerfile = (DEPLOY / "Dockerfile").read_text().splitlines()
    (line,) = [line for line in dockerfile if line.startswith("ENTRYPOINT ")]
    return json.loads(line.removeprefix("ENTRYPOINT "))


def test_the_images_entrypoint_runs_the_role_under_umask_077(tmp_path) -> None:
    """The entrypoint run here, as the image runs it, before a role that writes a file."""
    written = tmp_path / "written"
    role = [
        sys.executable,
        "-c",
        "import sys; open(sys.argv[1], 'w').write('x'); print('role', sys.argv[2])",
        str(written),
        "with 'quoted' args",
    ]
    result = subprocess.run(_image_entrypoint() + role, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "role with 'quoted' args\n"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


def test_compose_keeps_the_images_entrypoints() -> None:
    """No service replaces its image's entrypoint: Ragblend's sets umask 077, valkey's runs
    valkey-server under umask 0077 (it does so for the command ``valkey-server``)."""
    compose = _compose()
    for name, service in compose["services"].items():
        assert "entrypoint" not in service, name
    assert compose["services"]["valkey"]["command"][0] == "valkey-server"


def test_every_role_runs_through_the_images_entrypoint(rendered) -> None:
    """``command:`` would replace the image's entrypoint (and its umask); ``args:`` only its
    CMD. Each pod runs as the image's user, its volumes owned by that user's group."""
    _, documents = rendered
    workloads = [*_by_kind(documents, "Deployment").values(), *_by_kind(documents, "Job").values()]
    assert len(workloads) >= 5
    for workload in workloads:
        container = _container(workload)
        name = workload["metadata"]["name"]
        assert "command" not in container and container["args"], name
        pod = workload["spec"]["template"]["spec"]["securityContext"]
        assert pod["runAsUser"] == 10001 and pod["fsGroup"] == 10001, name
