"""deploy/kuberay's manifests against KubeRay's own CRD schemas (vendored in
tests/fixtures/kuberay, see SOURCE.md there), the way the API server and ``kubectl
--validate=strict`` would judge them, plus KubeRay's own admission rules that apply and
what planaria relies on: the head takes no workers, one GPU per worker pod, the preStop
hook and its timing, the entrypoint parsed by planaria's own CLI."""

from __future__ import annotations

import copy
import gzip
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from planaria.cli.main import _parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kuberay"
SCHEMAS = Path(__file__).resolve().parents[1] / "fixtures" / "kuberay"
CRDS = {("ray.io/v1", "RayCluster"): "rayclusters", ("ray.io/v1", "RayJob"): "rayjobs"}


def _schema(kind: str) -> dict[str, Any]:
    with gzip.open(SCHEMAS / f"{kind}.v1.schema.json.gz") as f:
        return json.load(f)


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs() if d["kind"] == kind]
    return doc


def unknown_fields(doc: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the schema does not know: the API server drops them from a CRD object (and
    ``kubectl --validate=strict``, the default since Kubernetes 1.27, refuses them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(doc, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in doc.items():
            if props is not None and key in props:
                found += unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, f"{path}.{key}")
            elif props is not None or extra is False:
                found.append(f"{path}.{key}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(doc):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """What the API server would refuse in a RayCluster or RayJob: schema violations and
    unknown fields."""
    kind = CRDS[(doc["apiVersion"], doc["kind"])]
    schema = _schema(kind)
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(doc)]
    return errors + [f"{p}: unknown field" for p in unknown_fields(doc, schema)]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def test_the_folder_holds_what_the_guide_applies():
    kinds = sorted(d["kind"] for d in _docs())
    assert kinds == ["PersistentVolumeClaim", "PriorityClass", "PriorityClass", "RayCluster",
                     "RayJob"]


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_manifests_validate_against_kuberays_crd_schemas(kind):
    assert schema_errors(_one(kind)) == []


def test_the_validator_catches_typos_and_missing_fields():
    cluster = _one("RayCluster")
    bad = copy.deepcopy(cluster)
    bad["spec"]["workerGroupSpecs"][0]["maxReplica"] = 8  # typo
    del bad["spec"]["workerGroupSpecs"][0]["groupName"]
    bad["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["lifecycle"][
        "preStop"]["exec"]["comand"] = ["x"]
    errors = schema_errors(bad)
    assert any("'groupName' is a required property" in e for e in errors), errors
    assert any(e.endswith("workerGroupSpecs[0].maxReplica: unknown field") for e in errors)
    assert any("preStop.exec.comand: unknown field" in e for e in errors), errors
    bad = copy.deepcopy(cluster)
    bad["spec"]["authOptions"]["mode"] = "tokens"
    assert any("'tokens' is not one of" in e for e in schema_errors(bad))


def test_kuberays_admission_rules_that_apply():
    """A subset of ray-operator/controllers/ray/utils/validation.go (same KubeRay commit)."""
    cluster, job = _one("RayCluster"), _one("RayJob")
    for name in (cluster["metadata"]["name"], job["metadata"]["name"]):
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 47
    spec = cluster["spec"]
    if spec["authOptions"]["mode"] == "token":
        assert _version(spec["rayVersion"]) >= (2, 52, 0), "token auth needs Ray >= 2.52"
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["template"]["spec"]["containers"]
    templates = [spec["headGroupSpec"]["template"]] + [
        g["template"] for g in spec["workerGroupSpecs"]]
    if spec["autoscalerOptions"].get("version") == "v2":
        assert all(t["spec"].get("restartPolicy", "Never") == "Never" for t in templates)
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    modes = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}  # rayjob_types.go
    assert job["spec"]["submissionMode"] in modes - {"SidecarMode"}  # no clusterSelector there
    assert "backoffLimit" not in job["spec"]  # incompatible with clusterSelector


def test_what_planaria_relies_on():
    cluster, job = _one("RayCluster"), _one("RayJob")
    spec = cluster["spec"]
    classes = {d["metadata"]["name"] for d in _docs() if d["kind"] == "PriorityClass"}
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no worker may land on the head"
    (gpu,) = spec["workerGroupSpecs"]
    pod = gpu["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert {head["template"]["spec"]["priorityClassName"], pod["priorityClassName"],
            job["spec"]["submitterPodTemplate"]["spec"]["priorityClassName"]} <= classes
    assert spec["enableInTreeAutoscaling"] is True

    # The preStop hook parses, and its waits fit in the grace period.
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["planaria", "node-drain-hook"]
    args = _parser().parse_args(hook[1:])
    env = {e["name"]: e["value"] for e in container["env"]}
    ray_drain_s = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
    assert args.grace_s + ray_drain_s < pod["terminationGracePeriodSeconds"]

    # The entrypoint parses with planaria's CLI; the script is where the image puts it; the
    # run directory is on the volume every pod mounts.
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "planaria"
    run = _parser().parse_args(argv[1:])
    assert run.command == "run" and run.address == "auto" and run.gpu
    assert run.replicas + run.spares <= gpu["maxReplicas"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(rf"^COPY .*deploy/kuberay/train.py {re.escape(run.target)}$", dockerfile,
                     re.M)
    assert f"rayproject/ray:{spec['rayVersion']}-" in dockerfile
    claim = {d["metadata"]["name"]: d for d in _docs() if d["kind"] == "PersistentVolumeClaim"}
    for template in (head["template"], gpu["template"]):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (mount,) = [m for m in template["spec"]["containers"][0]["volumeMounts"]
                    if str(run.run_dir).startswith(m["mountPath"] + "/")]
        name = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
        assert claim[name]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_spec_the_image_trains_loads(tmp_path):
    from planaria.cli.main import load_spec

    spec = load_spec(str(DEPLOY / "train.py"))
    job = shlex.split(_one("RayJob")["spec"]["entrypoint"])
    replicas = int(job[job.index("--replicas") + 1])
    assert spec.global_batch_size // spec.micro_batch_size >= replicas
