"""The Kubernetes engine: its manifests checked against the official client's models (and the Kubeflow CRDs'
schemas), the YAML round trip, the states read from Jobs built with the client's models, and a one-line error
where no cluster answers. There is no cluster here, and no fake API server: nothing is created."""

from __future__ import annotations

import socket
import time
from datetime import UTC, datetime

import pytest
import yaml

from redline.capability import is_available
from redline.errors import BadInput, RedlineError
from redline.queue import kubernetes as k8s
from redline.queue.spec import STATES, JobSpec

pytestmark = pytest.mark.skipif(not is_available("kubernetes"), reason="needs the kubernetes client")

IMAGE = "nvcr.io/nvidia/pytorch:25.01-py3"
ENV = {
    "HF_HOME": "/data/hf",
    "PYTHONPATH": "src",
    "NCCL_DEBUG": "INFO",
    "PATH": "/home/alice/.venv/bin:/usr/bin",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    "CUDA_VISIBLE_DEVICES": "3",
    "HOME": "/home/alice",
    "USER": "alice",
    "SSH_AUTH_SOCK": "/tmp/ssh-x/agent.1",
    "SLURM_JOB_ID": "42",
    "MASTER_ADDR": "node7",
    "PET_NNODES": "2",
    "KUBERNETES_SERVICE_HOST": "10.0.0.1",
}
KEPT = ["HF_HOME", "NCCL_DEBUG", "PYTHONPATH"]


def spec(**fields) -> JobSpec:
    base = {
        "argv": ("torchrun", "--standalone", "train.py", "--name", "a b; rm -rf /"),
        "name": "Llama 8B / fine-tune",
        "gpus": 8,
        "retries": 2,
        "time_limit_s": 3600.5,
        "cwd": "/home/alice/proj",
        "env": ENV,
        "queue": "team-a",
    }
    return JobSpec(**(base | fields))


def test_a_job_is_a_valid_v1job_with_the_spec_carried():
    from kubernetes.client import V1Job

    obj = k8s.manifest(spec(), image=IMAGE, namespace="ml")
    k8s.check(obj)
    job = V1Job.model_validate(obj)  # the client's model: types, required fields, no unknown field
    container = job.spec.template.spec.containers[0]
    assert container.command == list(spec().argv) and container.args is None  # the argv exactly, no shell
    assert container.working_dir == "/home/alice/proj"
    assert container.resources.limits == {"nvidia.com/gpu": "8"}
    assert [e.name for e in container.env] == KEPT
    assert job.spec.template.spec.restart_policy == "Never"  # the pod failure policy requires it
    assert job.spec.active_deadline_seconds == 3601  # the limit, rounded up
    assert job.spec.backoff_limit == 2
    assert job.spec.suspend is True
    rules = job.spec.pod_failure_policy.rules
    assert [r.action for r in rules] == ["Count", "FailJob"]  # disruptions retried first, any other exit fails
    assert rules[0].on_pod_conditions[0].type == "DisruptionTarget"
    assert (rules[1].on_exit_codes.operator, rules[1].on_exit_codes.values) == ("NotIn", [0])
    assert job.metadata.namespace == "ml"
    assert job.metadata.labels == {"app.kubernetes.io/managed-by": "redline", "kueue.x-k8s.io/queue-name": "team-a"}
    assert job.metadata.annotations == {"redline/name": "Llama 8B / fine-tune", "redline/user": "alice"}


def test_a_job_without_gpus_queue_or_limit_asks_for_none_of_them():
    obj = k8s.manifest(spec(gpus=0, queue=None, time_limit_s=None, cwd="", retries=0), image=IMAGE)
    k8s.check(obj)
    container = obj["spec"]["template"]["spec"]["containers"][0]
    assert "resources" not in container and "workingDir" not in container
    assert {"suspend", "activeDeadlineSeconds"}.isdisjoint(obj["spec"])
    assert "kueue.x-k8s.io/queue-name" not in obj["metadata"]["labels"]


def test_the_kueue_priority_class_is_a_label_when_given():
    obj = k8s.manifest(spec(), image=IMAGE, priority_class="high")
    assert obj["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"


def test_names_are_rfc1035_labels_short_enough_for_the_derived_names():
    for label in ("Llama 8B / fine-tune", "123-go", "___", "x" * 200):
        name = k8s.manifest(spec(name=label), image=IMAGE)["metadata"]["name"]
        assert k8s._NAME_RULE.match(name) and len(name) <= 40, name
    first, second = (k8s.manifest(spec(), image=IMAGE)["metadata"]["name"] for _ in range(2))
    assert first != second and first.startswith("llama-8b-fine-tune-")


def test_the_yaml_round_trips_to_the_same_manifest():
    for kind in k8s.KINDS:
        one = spec(nodes=1 if kind == "job" else 3, retries=0 if kind == "trainjob" else 2)
        text = k8s.render(one, image=IMAGE, kind=kind, name="llama-1")
        assert yaml.safe_load(text) == k8s.manifest(one, image=IMAGE, kind=kind, name="llama-1")
        assert "&id" not in text  # no YAML anchors: each replica's template is written out


def test_several_nodes_default_to_a_trainjob_that_fits_its_crd():
    obj = k8s.manifest(spec(nodes=4, retries=0), image=IMAGE)
    k8s.check(obj)
    assert (obj["apiVersion"], obj["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    body = obj["spec"]
    assert body["runtimeRef"] == {"name": "torch-distributed"}
    assert (body["suspend"], body["activeDeadlineSeconds"]) == (True, 3601)
    trainer = body["trainer"]
    assert trainer["command"] == list(spec().argv) and trainer["image"] == IMAGE
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 8)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert [e["name"] for e in trainer["env"]] == KEPT  # no PET_*: the TrainJob webhook rejects them


def test_a_pytorchjob_has_one_master_and_the_other_nodes_as_workers():
    from kubernetes.client import V1PodTemplateSpec

    obj = k8s.manifest(spec(nodes=3), image=IMAGE, kind="pytorchjob", runtime="unused")
    k8s.check(obj)
    assert (obj["apiVersion"], obj["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = obj["spec"]["pytorchReplicaSpecs"]
    assert {role: r["replicas"] for role, r in replicas.items()} == {"Master": 1, "Worker": 2}
    assert {r["restartPolicy"] for r in replicas.values()} == {"ExitCode"}
    for replica in replicas.values():
        pod = V1PodTemplateSpec.model_validate(replica["template"])
        assert pod.spec.containers[0].name == "pytorch"  # the operator's default container
        assert pod.spec.containers[0].command == list(spec().argv)
    assert obj["spec"]["nprocPerNode"] == "8"
    assert obj["spec"]["runPolicy"] == {"backoffLimit": 2, "activeDeadlineSeconds": 3601, "suspend": True}
    single = k8s.manifest(spec(nodes=1), image=IMAGE, kind="pytorchjob")
    assert list(single["spec"]["pytorchReplicaSpecs"]) == ["Master"]


@pytest.mark.parametrize(
    ("fields", "options", "words"),
    [
        ({"after": ("7",)}, {}, "--after"),
        ({"nodes": 2}, {"kind": "job"}, "one node"),
        ({"nodes": 2, "retries": 1}, {}, "--retries"),
        ({}, {"kind": "mpijob"}, "no Kubernetes kind"),
        ({}, {"image": ""}, "--image"),
    ],
)
def test_what_kubernetes_cannot_carry_is_refused_in_one_line(fields, options, words):
    with pytest.raises(BadInput, match=words) as caught:
        k8s.manifest(spec(**fields), **({"image": IMAGE} | options))
    assert "\n" not in str(caught.value)


def _broken(kind: str, change) -> dict:
    obj = k8s.manifest(spec(nodes=1 if kind == "job" else 2, retries=0), image=IMAGE, kind=kind)
    change(obj)
    return obj


@pytest.mark.parametrize(
    ("kind", "change", "words"),
    [
        ("job", lambda o: o["spec"].update(backofLimit=1), "spec.backofLimit: Extra inputs"),
        ("job", lambda o: o["spec"].update(backoffLimit="2"), "spec.backoffLimit: Input should be a valid integer"),
        ("job", lambda o: o["spec"]["template"]["spec"]["containers"][0].pop("name"), "containers.0.name: Field"),
        (
            "job",
            lambda o: o["spec"]["template"]["spec"]["containers"][0].update(
                resources={"limits": {"nvidia.com/gpu": 8}}
            ),
            "valid string",
        ),
        ("trainjob", lambda o: o["spec"].pop("runtimeRef"), "spec.runtimeRef: required"),
        ("trainjob", lambda o: o["spec"]["trainer"].update(numNodes="4"), "spec.trainer.numNodes: an integer"),
        ("trainjob", lambda o: o["spec"]["trainer"].update(workingDir="/x"), "spec.trainer.workingDir: unknown"),
        ("trainjob", lambda o: o["spec"]["trainer"]["env"].append({"value": "1"}), "env[3].name: Field required"),
        ("trainjob", lambda o: o["spec"].update(activeDeadlineSeconds=0), "out of range"),
        ("trainjob", lambda o: o["metadata"].update(name="9-lives"), "RFC 1035"),
        ("job", lambda o: o["metadata"].update(name="Llama"), "metadata.name: a DNS label"),
        ("job", lambda o: o["metadata"]["labels"].update({"kueue.x-k8s.io/queue-name": "team a"}), "queue-name: at"),
        (
            "pytorchjob",
            lambda o: o["metadata"]["labels"].update({"kueue.x-k8s.io/priority-class": "x" * 64}),
            "priority-class: at most",
        ),
        ("trainjob", lambda o: o["spec"]["trainer"].update(command=["x"] * 129), "command: more than 128 items"),
        ("trainjob", lambda o: o.update(apiVersion="kubeflow.org/v2alpha1"), "apiVersion"),
        ("pytorchjob", lambda o: o["spec"]["runPolicy"].update(backoffLimit=2**31), "out of range"),
        (
            "pytorchjob",
            lambda o: o["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"].update(containers=5),
            "Master.template.spec.containers",
        ),
        ("pytorchjob", lambda o: o["spec"].pop("pytorchReplicaSpecs"), "pytorchReplicaSpecs: required"),
    ],
)
def test_a_broken_manifest_is_caught_in_one_line(kind, change, words):
    with pytest.raises(BadInput) as caught:
        k8s.check(_broken(kind, change))
    assert words in str(caught.value) and "\n" not in str(caught.value)


def _job(conditions=(), *, active=None, suspend=False, deleted=False, start=True):
    """A Job as the API server reports it, built with the client's models."""
    from kubernetes.client import V1Job, V1JobCondition, V1JobSpec, V1JobStatus, V1ObjectMeta

    t0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
    t1 = datetime(2026, 12, 4, 13, 0, tzinfo=UTC)
    made = k8s.manifest(spec(), image=IMAGE, name="llama-abc123")
    return V1Job(
        metadata=V1ObjectMeta(
            name="llama-abc123",
            annotations=made["metadata"]["annotations"],
            creation_timestamp=t0,
            deletion_timestamp=t1 if deleted else None,
        ),
        spec=V1JobSpec.model_validate(made["spec"] | {"suspend": suspend}),
        status=V1JobStatus(
            active=active,
            start_time=t0 if start else None,
            conditions=[
                V1JobCondition(type=kind, status=status, reason=reason, last_transition_time=t1)
                for kind, status, reason in conditions
            ]
            or None,
        ),
    )


@pytest.mark.parametrize(
    ("job", "state", "reason"),
    [
        (_job([("Complete", "True", None)]), "done", ""),
        (_job([("FailureTarget", "True", "BackoffLimitExceeded")]), "failed", "BackoffLimitExceeded"),
        (_job([("Failed", "True", "DeadlineExceeded")]), "failed", "DeadlineExceeded"),
        (_job([("Failed", "True", "PodFailurePolicy")]), "failed", "PodFailurePolicy"),
        (_job([("Suspended", "True", "JobSuspended")], suspend=True, start=False), "queued", "waiting for Kueue"),
        (_job([("Suspended", "False", "JobResumed")], active=2), "running", "2 pods active"),
        (_job(active=1), "running", "1 pod active"),
        (_job(start=False), "queued", "pods pending"),
        (_job(active=1, deleted=True), "cancelled", "deleted"),
    ],
)
def test_a_jobs_conditions_map_to_states(job, state, reason):
    row = k8s.job_state(job)
    assert row.state == state and row.state in STATES
    assert reason in row.reason
    assert (row.engine, row.id, row.name, row.user) == ("kubernetes", "llama-abc123", "Llama 8B / fine-tune", "alice")
    assert row.submitted_at == datetime(2026, 12, 4, 12, 0, tzinfo=UTC).timestamp()
    assert (row.exit_code == 0) == (state == "done")
    assert (row.ended_at is not None) == (state in ("done", "failed"))


def test_a_job_as_submitted_reads_as_queued():
    from kubernetes.client import V1Job

    assert k8s.job_state(V1Job.model_validate(k8s.manifest(spec(), image=IMAGE))).state == "queued"


@pytest.mark.parametrize(
    ("kind", "status", "state"),
    [
        ("TrainJob", {"conditions": [{"type": "Complete", "status": "True"}]}, "done"),
        ("TrainJob", {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}, "failed"),
        ("TrainJob", {"conditions": [{"type": "Suspended", "status": "True"}]}, "queued"),
        (
            "TrainJob",
            {"conditions": [{"type": "Suspended", "status": "False"}], "jobsStatus": [{"active": 2}]},
            "running",
        ),
        ("TrainJob", {}, "queued"),
        (
            "PyTorchJob",
            {"conditions": [{"type": "Created", "status": "True"}, {"type": "Running", "status": "True"}]},
            "running",
        ),
        ("PyTorchJob", {"conditions": [{"type": "Succeeded", "status": "True"}]}, "done"),
        ("PyTorchJob", {"conditions": [{"type": "Restarting", "status": "True"}]}, "running"),
    ],
)
def test_a_custom_jobs_conditions_map_to_states(kind, status, state):
    obj = k8s.manifest(spec(nodes=2, retries=0), image=IMAGE, kind=kind.lower(), name="llama-abc123")
    obj["metadata"]["creationTimestamp"] = "2026-12-04T12:00:00Z"
    row = k8s.custom_state(obj | {"status": status})
    assert row.state == state
    assert row.id == f"{kind.lower()}/llama-abc123" and row.name == "Llama 8B / fine-tune"
    assert row.submitted_at == datetime(2026, 12, 4, 12, 0, tzinfo=UTC).timestamp()


@pytest.fixture
def unreachable_cluster(tmp_path, monkeypatch):
    """A kubeconfig whose server is a port on this machine that nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}}
        ],
        "users": [{"name": "u", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", str(path))
    return port


def test_submit_without_a_reachable_cluster_is_one_line(unreachable_cluster):
    started = time.monotonic()
    for call in (
        lambda: k8s.submit(spec(), image=IMAGE),
        lambda: k8s.submit(spec(nodes=2, retries=0), image=IMAGE),
        lambda: k8s.jobs(),
        lambda: k8s.cancel("trainjob/llama-abc123"),
    ):
        with pytest.raises(RedlineError) as caught:
            call()
        message = str(caught.value)
        assert type(caught.value) is RedlineError  # the cluster, not the input, is at fault: exit code 1
        assert message.startswith("cannot reach the Kubernetes API server at ") and "\n" not in message
        assert f"127.0.0.1:{unreachable_cluster}" in message
    assert time.monotonic() - started < 20  # refused at once, not retried


def test_no_kubeconfig_and_no_pod_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(BadInput, match=r"^no Kubernetes cluster: ") as caught:
        k8s.submit(spec(), image=IMAGE)
    assert "\n" not in str(caught.value)


def test_a_bad_job_id_is_refused_before_any_connection():
    with pytest.raises(BadInput, match="no Kubernetes job id"):
        k8s.cancel("deployment/x")


def test_without_the_client_it_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(k8s, "is_available", lambda package: package != "kubernetes")
    with pytest.raises(BadInput, match=r"^Kubernetes jobs need the official client: pip install kubernetes$"):
        k8s.render(spec(), image=IMAGE)
