"""`trainscale k8s` as a user runs it: the PyTorchJob manifest it writes, checked against the Kubernetes schemas
(kubernetes-validate, offline) and the PyTorchJob CRD's own schema (tests/data), and the -o paths it refuses.
Nothing talks to a cluster."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainscale.runtime import kubernetes

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate, in the test extra")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
TRAINSCALE = [sys.executable, "-m", "trainscale.cli"]
CRD_SCHEMA = Path(__file__).with_name("data") / "pytorchjob-v1.schema.json"


def _k8s(*args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*TRAINSCALE, "k8s", *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env)


def _closed(schema):
    """The CRD's schema with unknown fields refused: the API server would prune them silently (a misspelt
    field is then simply gone), so a manifest of ours must not have any."""
    schema = copy.deepcopy(schema)
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for key in ("properties", "additionalProperties", "items"):
            if isinstance(schema.get(key), dict):
                inner = schema[key]
                schema[key] = {k: _closed(v) for k, v in inner.items()} if key == "properties" else _closed(inner)
    return schema


def _validate(docs: list[dict]) -> None:
    version = kubernetes_validate.utils.latest_version()
    pvcs = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    [job] = [d for d in docs if d["kind"] == "PyTorchJob"]
    for pvc in pvcs:
        kubernetes_validate.validate(pvc, version, strict=True)
    jsonschema.validate(job, _closed(json.loads(CRD_SCHEMA.read_text())))
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():  # each pod template as core/v1 sees it
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                                      "template": spec["template"]}, version, strict=True)


def test_manifest_for_two_nodes_of_eight_gpus_is_valid(tmp_path):
    out = _k8s("--nodes", "2", "--gpus-per-node", "8", "--image", "registry.example/team/train:1", "--memory-per-node",
               "200Gi", "-o", "job.yaml", "train.py", "--lr", "1e-3", "--name", "it's \"x\"\nnext", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "kubectl apply -f job.yaml" in out.stdout
    docs = list(yaml.safe_load_all((tmp_path / "job.yaml").read_text()))
    _validate(docs)
    pvc, job = docs
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["metadata"]["name"] == "trainscale-checkpoints"
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8" and spec["runPolicy"] == {"backoffLimit": 3}
    master, worker = spec["pytorchReplicaSpecs"]["Master"], spec["pytorchReplicaSpecs"]["Worker"]
    assert (master["replicas"], worker["replicas"]) == (1, 1)
    assert master["restartPolicy"] == worker["restartPolicy"] == "OnFailure"
    [container] = master["template"]["spec"]["containers"]
    assert container["name"] == "pytorch"
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
    assert container["command"] == ["python", "train.py", "--lr", "1e-3", "--name", "it's \"x\"\nnext"]
    # string values quoted: a YAML 1.2 reader (Kubernetes') takes a plain 1e-3 for a number; keys plain
    assert '- "1e-3"' in (tmp_path / "job.yaml").read_text() and "\n  nprocPerNode: \"8\"\n" in (tmp_path / "job.yaml").read_text()
    assert container["resources"] == {"requests": {"cpu": "64", "memory": "200Gi"},
                                      "limits": {"nvidia.com/gpu": 8, "memory": "200Gi"}}
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in container["volumeMounts"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "trainscale-checkpoints"}} in \
        master["template"]["spec"]["volumes"]
    # /dev/shm in memory, bounded: without sizeLimit it could take the node's RAM (no memory limit on a pod)
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in master["template"]["spec"]["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_the_shm_size_flag_sets_the_limit(tmp_path):
    out = _k8s("--nodes", "1", "--gpus-per-node", "2", "--image", "img", "--shm-size", "64Gi", "train.py",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    [_, job] = list(yaml.safe_load_all(out.stdout))
    _validate([job])
    volumes = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in volumes


def test_cpu_pods_on_an_existing_claim_and_one_node(tmp_path):
    docs = kubernetes.pytorchjob_manifest(["python", "t.py"], nodes=1, gpus_per_node=4, image="img", cpu=True,
                                          checkpoint_claim="shared-ckpt", job_name="cpu-run")
    _validate(docs)
    [job] = docs
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "4"}}
    assert list(yaml.safe_load_all(kubernetes.to_yaml(docs))) == docs


def test_the_validation_catches_a_misspelt_field():
    [job] = kubernetes.pytorchjob_manifest(["python", "t.py"], nodes=2, gpus_per_node=1, image="img",
                                           checkpoint_claim="c")
    job["spec"]["nprocsPerNode"] = job["spec"].pop("nprocPerNode")
    with pytest.raises(jsonschema.ValidationError, match="nprocsPerNode"):
        _validate([job])
    [job] = kubernetes.pytorchjob_manifest(["python", "t.py"], nodes=2, gpus_per_node=1, image="img",
                                           checkpoint_claim="c")
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="resource"):
        _validate([job])


def test_output_paths_that_are_refused(tmp_path):
    common = ("--nodes", "2", "--gpus-per-node", "1", "--image", "img")
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "train.py").write_text("print('train')\n")
    os.symlink("train.py", tmp_path / "link.py")
    for path, message in (("notes.txt", "exists and was not written by `trainscale k8s`"),
                          ("train.py", "is the training script"), ("link.py", "is the training script"),
                          (".", "exists and is not a file")):
        out = _k8s(*common, "-o", path, "train.py", cwd=tmp_path)
        assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out
    assert (tmp_path / "notes.txt").read_text() == "my notes\n" and "print" in (tmp_path / "train.py").read_text()
    assert _k8s(*common, "-o", "job.yaml", "train.py", cwd=tmp_path).returncode == 0
    again = _k8s(*common, "--job-name", "second", "-o", "job.yaml", "train.py", cwd=tmp_path)  # a manifest of ours
    assert again.returncode == 0 and "name: \"second\"" in (tmp_path / "job.yaml").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--nodes", "0"], "--nodes 0"), (["--job-name", "My_Job"], "--job-name 'My_Job' must be a DNS label"),
    (["--checkpoint-size", "lots"], "--checkpoint-size 'lots' is not a Kubernetes quantity"),
    (["--image", "a b"], "--image 'a b'"), (["--checkpoint-dir", "ckpt"], "must be an absolute path"),
    (["--shm-size", "half"], "--shm-size 'half' is not a Kubernetes quantity"),
    # given as 0 or empty, these were replaced by their defaults or written as a zero request
    (["--cpus-per-node", "0"], "--cpus-per-node 0"), (["--memory-per-node", "0"], "--memory-per-node '0' is zero"),
    (["--checkpoint-size", "0Gi"], "--checkpoint-size '0Gi' is zero"), (["--shm-size", ""], "--shm-size ''"),
    (["--python", ""], "--python '' names no program"),
])
def test_bad_flags_are_one_line_errors(tmp_path, flags, message):
    args = {"--nodes": "2", "--gpus-per-node": "1", "--image": "img"}
    for i in range(0, len(flags), 2):
        args[flags[i]] = flags[i + 1]
    out = _k8s(*[x for kv in args.items() for x in kv], "train.py", cwd=tmp_path)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
