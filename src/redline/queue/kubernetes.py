"""A job spec handed to Kubernetes: a batch/v1 Job on one node, a Kubeflow TrainJob or PyTorchJob past one.

Which kind (``kind=None`` picks):

* ``job`` (one node, the default there): a plain batch/v1 Job, one pod with the job's GPUs as
  ``nvidia.com/gpu`` limits. Kubernetes and Kueue run it with nothing else installed.
* ``trainjob`` (several nodes, the default there): Kubeflow Trainer v2's TrainJob
  (``trainer.kubeflow.org/v1alpha1``), which names a training runtime (``torch-distributed`` by default) and sets
  the nodes and each node's resources. It is the successor of the PyTorchJob and the one Kueue keeps supporting:
  Kueue deprecated its Trainer v1 integrations (PyTorchJob among them), their removal planned for Kueue v0.20.
* ``pytorchjob``: Kubeflow Training Operator v1's PyTorchJob (``kubeflow.org/v1``), one Master and nodes - 1
  Workers, for the many clusters that still run Trainer v1.

On every node the argv runs as given, no shell between. The operators set torchrun's ``PET_*`` variables (nodes,
processes per node, node rank, master address), so an argv that starts with ``torchrun`` needs no rendezvous
options; the PyTorchJob also sets ``MASTER_ADDR``, ``RANK`` and ``WORLD_SIZE`` for one process a node.

Kueue: the queue is the ``kueue.x-k8s.io/queue-name`` label on the job, naming a LocalQueue. The job is created
suspended, as Kueue's guides allow (its webhook would suspend it anyway): a job meant for a queue never starts
outside it, even where Kueue is missing; there it waits, shown as queued. A Kueue priority is a
WorkloadPriorityClass, which has a name, so it is the ``priority_class`` argument; the spec's whole-number
priority, which has no name, is not carried.

Retries count preemption-class ends, as the local queue's do, in each kind's terms: a Job's pod failure policy
counts a pod Kubernetes disrupted (preempted, evicted, its node drained: the DisruptionTarget condition) against
backoffLimit and fails the job on any other non-zero exit; a PyTorchJob's ExitCode restart policy restarts a
replica that a signal ended (exit codes 128-255, an out-of-memory kill among them) and fails on 1-127.

What Kubernetes cannot carry is refused in one line, not dropped: ``after`` (Kubernetes has no dependencies between
jobs), nodes > 1 on a Job, retries on a TrainJob (its runtime sets restarts). Per-device memory has no Kubernetes
resource and is not carried; nor is ``exclusive``, as the device plugin hands out whole GPUs (unless the cluster
turned on time-slicing). A TrainJob's trainer has no working directory field: it runs in the image's.

The manifests are checked before they are printed or sent: the Job against the official client's models (the
pydantic models of kubernetes 37: types, required fields, unknown fields), the TrainJob and PyTorchJob, which the client
has no models for, against a trimmed copy of their CRDs' schemas (below) with their pod templates, environment and
resources checked against the client's models again.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from copy import deepcopy
from datetime import datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any

from redline.capability import is_available
from redline.errors import BadInput, RedlineError, one_line
from redline.queue.engine import Engine
from redline.queue.spec import EngineJob, JobSpec

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, V1Job
    from kubernetes.client.exceptions import ApiException

KINDS = ("job", "trainjob", "pytorchjob")
MANAGED_BY = {"app.kubernetes.io/managed-by": "redline"}
SELECTOR = "app.kubernetes.io/managed-by=redline"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
NAME_ANNOTATION = "redline/name"
USER_ANNOTATION = "redline/user"
GPU = "nvidia.com/gpu"
TIMEOUT_S = (5, 30)  # connect, read: a cluster that does not answer is an error in seconds, not minutes

# (group, version, plural) of the custom resources
TRAINJOB = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
PYTORCHJOB = ("kubeflow.org", "v1", "pytorchjobs")

# The environment captured at submit time describes the submitting host; these parts of it would be wrong, or
# harmful, in a pod and are left out:
# - the login session: home, shell, terminal, display, ssh agent, tmux: none of it exists in the pod;
# - where the host's software lives (PATH, LD_LIBRARY_PATH, LD_PRELOAD, a virtualenv or conda): the image brings its
#   own, and the host's PATH would hide the image's python and CUDA libraries;
# - the host's device selection (CUDA_VISIBLE_DEVICES and kin): the device plugin gives the pod its GPUs, numbered
#   from 0, and a host index would hide them;
# - launchers' and schedulers' variables (Slurm, MPI, torch.distributed's rank and rendezvous, torchrun's PET_*,
#   the in-cluster API address): the operators set their own, and the TrainJob webhook rejects PET_* outright.
# PYTHONPATH and the rest stay: they are the job's settings. Values land in the job object in clear: secrets
# belong in a Kubernetes Secret, not in the environment of `redline submit`.
HOST_ONLY_ENV = frozenset(
    {
        "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "HOSTNAME", "MAIL", "_",
        "TERM", "COLORTERM", "DISPLAY", "WAYLAND_DISPLAY", "XAUTHORITY", "DBUS_SESSION_BUS_ADDRESS",
        "TMUX", "TMUX_PANE", "STY", "WINDOW", "LS_COLORS", "LESSOPEN", "LESSCLOSE", "KUBECONFIG",
        "PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "PYTHONHOME",
        "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
        "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "NODE_RANK",
    }
)  # fmt: skip
HOST_ONLY_PREFIXES = (
    "SSH_", "XDG_", "TERM_", "CONDA_", "SLURM_", "SBATCH_", "SRUN_", "OMPI_", "PMI_", "PMIX_", "PET_",
    "TORCHELASTIC_", "KUBERNETES_",
)  # fmt: skip


def job_env(env: Mapping[str, str]) -> list[dict[str, str]]:
    """The captured environment as a container's ``env``, without the host's own variables (see HOST_ONLY_ENV)."""
    return [
        {"name": name, "value": value}
        for name, value in sorted(env.items())
        if name not in HOST_ONLY_ENV and not name.startswith(HOST_ONLY_PREFIXES)
    ]


def object_name(label: str, suffix: str) -> str:
    """A name every kind takes: an RFC 1035 label (what the TrainJob and PyTorchJob require), short enough that
    the names their controllers derive from it (``<name>-node-0-0``) stay within 63 characters."""
    base = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
    if not base or not base[0].isalpha():
        base = f"job-{base}".rstrip("-")
    return f"{base[:33].rstrip('-')}-{suffix}"


def manifest(
    spec: JobSpec,
    *,
    image: str,
    kind: str | None = None,
    namespace: str = "default",
    name: str | None = None,
    runtime: str = "torch-distributed",
    priority_class: str | None = None,
) -> dict[str, Any]:
    """The object to create for ``spec``: a Job, TrainJob or PyTorchJob (see the module's docstring), as a dict.

    ``image`` is the container image the argv runs in; ``name`` defaults to the job's label and 6 random hex
    digits; ``runtime`` is the TrainJob's ClusterTrainingRuntime.
    """
    kind = kind or ("job" if spec.nodes == 1 else "trainjob")
    _refuse_what_cannot_be_carried(spec, kind, image)
    metadata = _metadata(spec, namespace, name, priority_class)
    if kind == "trainjob":
        return _trainjob(spec, image, runtime, metadata)
    pod = _pod(spec, image, container_name="pytorch" if kind == "pytorchjob" else "main")
    if kind == "pytorchjob":
        return _pytorchjob(spec, pod, metadata)
    return _job(spec, pod, metadata)


def _refuse_what_cannot_be_carried(spec: JobSpec, kind: str, image: str) -> None:
    if kind not in KINDS:
        raise BadInput(f"no Kubernetes kind {kind!r}: one of {', '.join(KINDS)}")
    if not image:
        raise BadInput("a Kubernetes job needs a container image (--image)")
    if spec.after:
        raise BadInput("Kubernetes has no dependencies between jobs: --after cannot be carried there")
    if kind == "job" and spec.nodes > 1:
        raise BadInput(f"a Job runs on one node, not {spec.nodes}: use a trainjob or pytorchjob")
    if kind == "trainjob" and spec.retries:
        raise BadInput("a TrainJob's restarts are set by its runtime, not per job: drop --retries or use a pytorchjob")


def _metadata(spec: JobSpec, namespace: str, name: str | None, priority_class: str | None) -> dict[str, Any]:
    """The object's name, namespace, labels (ours, Kueue's queue and priority class) and annotations."""
    labels = dict(MANAGED_BY)
    if spec.queue:
        labels[QUEUE_LABEL] = spec.queue
    if priority_class:
        labels[PRIORITY_LABEL] = priority_class
    annotations = {NAME_ANNOTATION: spec.label}
    user = spec.env.get("USER") or spec.env.get("LOGNAME")
    if user:
        annotations[USER_ANNOTATION] = user
    return {
        "name": name or object_name(spec.label, secrets.token_hex(3)),
        "namespace": namespace,
        "labels": labels,
        "annotations": annotations,
    }


def _deadline(spec: JobSpec) -> int | None:
    return math.ceil(spec.time_limit_s) if spec.time_limit_s else None


def _gpu_limits(spec: JobSpec) -> dict[str, str]:
    return {GPU: str(spec.gpus)} if spec.gpus else {}


def _trainjob(spec: JobSpec, image: str, runtime: str, metadata: dict[str, Any]) -> dict[str, Any]:
    trainer: dict[str, Any] = {"image": image, "command": list(spec.argv), "numNodes": spec.nodes}
    if spec.gpus:
        trainer |= {"numProcPerNode": spec.gpus, "resourcesPerNode": {"limits": _gpu_limits(spec)}}
    if env := job_env(spec.env):
        trainer["env"] = env
    body: dict[str, Any] = {"suspend": True} if spec.queue else {}
    body["runtimeRef"] = {"name": runtime}
    if deadline := _deadline(spec):
        body["activeDeadlineSeconds"] = deadline  # Trainer v2.2 and later
    body["trainer"] = trainer
    return {"apiVersion": "/".join(TRAINJOB[:2]), "kind": "TrainJob", "metadata": metadata, "spec": body}


def _pod(spec: JobSpec, image: str, container_name: str) -> dict[str, Any]:
    """The pod template: one container running the argv (the PyTorchJob operator looks for one named "pytorch")."""
    container: dict[str, Any] = {"name": container_name, "image": image, "command": list(spec.argv)}
    if spec.cwd:
        container["workingDir"] = spec.cwd
    if env := job_env(spec.env):
        container["env"] = env
    if limits := _gpu_limits(spec):
        container["resources"] = {"limits": limits}
    return {"metadata": {"labels": dict(MANAGED_BY)}, "spec": {"restartPolicy": "Never", "containers": [container]}}


def _pytorchjob(spec: JobSpec, pod: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    # ExitCode: the operator restarts a replica that ended by a signal (exit codes 128-255: preemption, a kill)
    # and fails the job on 1-127, the program's own errors; backoffLimit counts those restarts
    replicas = {"Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": pod}}
    if spec.nodes > 1:  # a copy: the YAML then repeats it instead of pointing to the Master's
        replicas["Worker"] = {"replicas": spec.nodes - 1, "restartPolicy": "ExitCode", "template": deepcopy(pod)}
    run_policy: dict[str, Any] = {"backoffLimit": spec.retries}
    if deadline := _deadline(spec):
        run_policy["activeDeadlineSeconds"] = deadline
    if spec.queue:
        run_policy["suspend"] = True
    body: dict[str, Any] = {"pytorchReplicaSpecs": replicas, "runPolicy": run_policy}
    if spec.gpus:
        body["nprocPerNode"] = str(spec.gpus)
    return {"apiVersion": "/".join(PYTORCHJOB[:2]), "kind": "PyTorchJob", "metadata": metadata, "spec": body}


def _job(spec: JobSpec, pod: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    # A pod's end counts against backoffLimit (the retries) only when Kubernetes disrupted it (preemption,
    # eviction, a node drained or lost: the DisruptionTarget condition); any other non-zero exit fails the job at
    # once, as Kubernetes' docs on the pod failure policy recommend. The rules apply in order.
    failure_policy = {
        "rules": [
            {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}},
        ]
    }
    body: dict[str, Any] = {"suspend": True} if spec.queue else {}
    body["backoffLimit"] = spec.retries
    if deadline := _deadline(spec):
        body["activeDeadlineSeconds"] = deadline
    body |= {"podFailurePolicy": failure_policy, "template": pod}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": body}


# -- checking a manifest -------------------------------------------------------------------------------------------

# Trimmed copies of the CRDs' openAPIV3Schema: types, formats, required fields, bounds, and every field name of the
# levels redline writes (so a misspelt one is caught, as the API server's strict field validation would);
# descriptions are dropped, fields redline never writes are kept as names only ("any": not looked into), and where a
# CRD embeds a core type, "model" names the client model that checks it. Sources, both Apache-2.0 (The Kubeflow
# Authors), as redline is:
# - TrainJob: github.com/kubeflow/trainer, manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml at v2.3.0
#   (the fields written here are in every v2 release; activeDeadlineSeconds since v2.2, numProcPerNode an
#   integer-or-string before v2.2);
# - PyTorchJob: the same repository, manifests/base/crds/kubeflow.org_pytorchjobs.yaml at v1.9.4.
_ANY = {"type": "object", "any": True}
_NAME_RULE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # both CRDs: metadata.name is an RFC 1035 label
_JOB_NAME_RULE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a Job's: a DNS label, as its pods' hostnames
_LABEL_VALUE_RULE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")  # at most 63 characters


def _int(bits: int, **bounds: int) -> dict[str, Any]:
    return {"type": "integer", "format": f"int{bits}", **bounds}


def _strings(max_items: int, max_length: int) -> dict[str, Any]:
    return {"type": "array", "maxItems": max_items, "items": {"type": "string", "maxLength": max_length}}


TRAINJOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["runtimeRef"],
    "properties": {
        "activeDeadlineSeconds": _int(64, minimum=1),
        "initializer": _ANY,
        "managedBy": {
            "type": "string",
            "maxLength": 253,
            "enum": ["trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"],
        },
        "runtimePatches": {"type": "array", "maxItems": 16, "items": _ANY},
        "runtimeRef": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "apiGroup": {"type": "string", "maxLength": 253},
                "kind": {"type": "string", "maxLength": 253},
                "name": {"type": "string", "maxLength": 253},
            },
        },
        "suspend": {"type": "boolean"},
        "trainer": {
            "type": "object",
            "properties": {
                "args": _strings(128, 1048576),
                "command": _strings(128, 1048576),
                "env": {"type": "array", "maxItems": 128, "items": {"model": "V1EnvVar"}},
                "image": {"type": "string", "maxLength": 500},
                "numNodes": _int(32),
                "numProcPerNode": _int(32),
                "resourcesPerNode": {"model": "V1ResourceRequirements"},
            },
        },
    },
}

_REPLICA = {
    "type": "object",
    "properties": {
        "replicas": _int(32),
        "restartPolicy": {"type": "string"},
        "template": {"model": "V1PodTemplateSpec"},
    },
}
PYTORCHJOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["pytorchReplicaSpecs"],
    "properties": {
        "elasticPolicy": _ANY,
        "nprocPerNode": {"type": "string"},
        "pytorchReplicaSpecs": {"type": "object", "additionalProperties": _REPLICA},
        "runPolicy": {
            "type": "object",
            "properties": {
                "activeDeadlineSeconds": _int(64),
                "backoffLimit": _int(32),
                "cleanPodPolicy": {"type": "string"},
                "managedBy": {"type": "string"},
                "schedulingPolicy": _ANY,
                "suspend": {"type": "boolean"},
                "ttlSecondsAfterFinished": _int(32),
            },
        },
    },
}

# type[Any]: a value that passes its isinstance check stays Any to the checks that follow (len, in, items)
_TYPES: dict[str, type[Any]] = {"object": dict, "array": list, "string": str, "boolean": bool}


def _check(value: Any, schema: Mapping[str, Any], path: str, errors: list[str]) -> None:
    """Append to ``errors`` where ``value`` breaks ``schema`` (the subset of OpenAPI v3 the trimmed CRDs use)."""
    if "model" in schema:
        _check_model(value, schema["model"], path, errors)
        return
    kind = schema["type"]
    if kind == "integer":
        bits = int(schema["format"].removeprefix("int"))
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"{path}: an integer, not {value!r}")
        elif not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1) or value < schema.get("minimum", value):
            errors.append(f"{path}: {value} is out of range")
        return
    if not isinstance(value, _TYPES[kind]):
        errors.append(f"{path}: a{'n' if kind[0] in 'aeiou' else ''} {kind}, not {value!r}")
        return
    if kind == "string":
        if len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
        if "enum" in schema and value not in schema["enum"]:
            errors.append(f"{path}: one of {', '.join(schema['enum'])}, not {value!r}")
    elif kind == "array":
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{path}: more than {schema['maxItems']} items")
        for index, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{index}]", errors)
    elif kind == "object" and not schema.get("any"):
        errors.extend(f"{path}.{field}: required" for field in schema.get("required", ()) if field not in value)
        properties = schema.get("properties", {})
        for field, item in value.items():
            if field in properties:
                _check(item, properties[field], f"{path}.{field}", errors)
            elif "additionalProperties" in schema:
                _check(item, schema["additionalProperties"], f"{path}.{field}", errors)
            else:
                errors.append(f"{path}.{field}: unknown field")


def _check_model(value: Any, model: str, path: str, errors: list[str]) -> None:
    """Check ``value`` against the client's model of that name; its complaints are appended, with their paths."""
    from kubernetes import client
    from pydantic import ValidationError

    try:
        getattr(client, model).model_validate(value)
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"])
            errors.append(f"{path}{'.' if where else ''}{where}: {error['msg']}")


def check(obj: Mapping[str, Any]) -> None:
    """Raise a one-line BadInput naming what is wrong with a manifest: a Job checked against the client's V1Job
    model, a TrainJob or PyTorchJob against its trimmed CRD schema (and its embedded core types against the
    client's models); names and label values (a queue's, a priority class's) against the API server's rules."""
    _client()
    errors: list[str] = []
    kind = obj.get("kind")
    given = obj.get("metadata")
    metadata = given if isinstance(given, Mapping) else {}
    name = metadata.get("name") or ""
    rule, rule_name = (_JOB_NAME_RULE, "a DNS label") if kind == "Job" else (_NAME_RULE, "an RFC 1035 label")
    if not isinstance(name, str) or not rule.match(name) or len(name) > 63:
        errors.append(f"metadata.name: {rule_name} of at most 63 characters, not {name!r}")
    for key, value in (metadata.get("labels") or {}).items():
        if not isinstance(value, str) or not _LABEL_VALUE_RULE.match(value) or len(value) > 63:
            errors.append(f"metadata.labels.{key}: at most 63 letters, digits, '-', '_' or '.', not {value!r}")
    if kind == "Job":
        _check_model(obj, "V1Job", "", errors)
    elif kind in ("TrainJob", "PyTorchJob"):
        schema, (group, version, _) = (
            (TRAINJOB_SCHEMA, TRAINJOB) if kind == "TrainJob" else (PYTORCHJOB_SCHEMA, PYTORCHJOB)
        )
        if obj.get("apiVersion") != f"{group}/{version}":
            errors.append(f"apiVersion: {group}/{version}, not {obj.get('apiVersion')!r}")
        _check_model(obj.get("metadata"), "V1ObjectMeta", "metadata", errors)
        if "spec" not in obj:
            errors.append("spec: required")
        else:
            _check(obj["spec"], schema, "spec", errors)
        errors.extend(f"{field}: unknown field" for field in set(obj) - {"apiVersion", "kind", "metadata", "spec"})
    else:
        errors.append(f"kind: Job, TrainJob or PyTorchJob, not {kind!r}")
    if errors:
        raise BadInput(f"the {kind or 'Kubernetes'} manifest is not valid: {'; '.join(errors)}")


def render(spec: JobSpec, **options: Any) -> str:
    """The manifest as YAML, checked first: what ``--dry-run`` prints and ``kubectl create -f -`` takes."""
    import yaml

    obj = manifest(spec, **options)
    check(obj)
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)


# -- the cluster ---------------------------------------------------------------------------------------------------


def _client() -> ModuleType:
    """The kubernetes package, or a one-line BadInput saying how to get it (as redline.capability does)."""
    if not is_available("kubernetes"):
        raise BadInput("Kubernetes jobs need the official client: pip install kubernetes")
    from kubernetes import client

    if not hasattr(client.V1Job, "model_validate"):
        raise BadInput("Kubernetes jobs need the client's checked models: pip install 'kubernetes>=37'")
    return client


def connect() -> ApiClient:
    """An API client for the cluster of the current kubeconfig context (KUBECONFIG or ~/.kube/config), or of the
    pod this runs in; a one-line BadInput when there is neither. Nothing is sent yet."""
    client = _client()
    from kubernetes import config

    configuration = client.Configuration()
    path = os.environ.get("KUBECONFIG", "~/.kube/config")  # read now: the client reads it once, at its import
    try:
        config.load_kube_config(path, client_configuration=configuration)
    except (config.ConfigException, OSError) as kube_error:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            raise BadInput(
                f"no Kubernetes cluster: no usable kubeconfig at {path} ({kube_error}), and not in a pod"
            ) from None
    configuration.retries = 0  # one refused connection is the answer; urllib3 would retry it three times
    return client.ApiClient(configuration)


def _call(
    api_client: ApiClient, what: str, call: Callable[..., Any], *args: Any, missing_ok: bool = False, **kwargs: Any
) -> Any:
    """Run one API call with short timeouts; what goes wrong is one line naming ``what`` and why: BadInput where
    the API server found the request invalid, RedlineError otherwise (refused, unreachable). With ``missing_ok``,
    a resource the cluster does not have (its operator is not installed) is None."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return call(*args, **kwargs, _request_timeout=TIMEOUT_S)
    except ApiException as exc:
        reason = _api_message(exc)
        if exc.status == 404 and "could not find the requested resource" in reason:
            if missing_ok:
                return None
            reason = "the cluster has no such resource (is the operator that defines it installed?)"
        error = BadInput if exc.status in (400, 422) else RedlineError
        raise error(f"Kubernetes refused to {what}: {exc.status} {reason}") from None
    except (HTTPError, OSError) as exc:
        host = api_client.configuration.host
        raise RedlineError(f"cannot reach the Kubernetes API server at {host} to {what}: {_first_line(exc)}") from None


def _api_message(exc: ApiException) -> str:
    import json

    if exc.body is None:  # no answer came with it
        return exc.reason or ""
    try:
        return json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):  # an answer that is not the API server's JSON Status
        return exc.reason or ""


def _first_line(exc: BaseException) -> str:
    """A connection error as one line: the error urllib3 wraps as its ``reason`` (the socket's), if any."""
    reason = getattr(exc, "reason", None)
    return one_line(reason if isinstance(reason, BaseException) else exc, typed=False)


def submit(spec: JobSpec, *, api_client: ApiClient | None = None, **options: Any) -> str:
    """Create the job in the cluster (strict field validation: an unknown field is an error, not dropped) and
    return its id: the Job's name, or ``trainjob/<name>`` / ``pytorchjob/<name>``."""
    obj = manifest(spec, **options)
    check(obj)
    api_client = api_client or connect()
    from kubernetes import client

    namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    if obj["kind"] == "Job":
        batch = client.BatchV1Api(api_client)
        _call(api_client, f"create Job {name}", batch.create_namespaced_job, namespace, obj, field_validation="Strict")
        return name
    group, version, plural = TRAINJOB if obj["kind"] == "TrainJob" else PYTORCHJOB
    custom = client.CustomObjectsApi(api_client)
    what = f"create {obj['kind']} {name}"
    _call(
        api_client,
        what,
        custom.create_namespaced_custom_object,
        group,
        version,
        namespace,
        plural,
        obj,
        field_validation="Strict",
    )
    return f"{plural.removesuffix('s')}/{name}"


def _split(job_id: str) -> tuple[tuple[str, str, str] | None, str]:
    kind, _, name = job_id.rpartition("/")
    if kind not in ("", "job", "trainjob", "pytorchjob") or not name:
        raise BadInput(f"no Kubernetes job id {job_id!r}: a Job's name, or trainjob/<name>, pytorchjob/<name>")
    return {"trainjob": TRAINJOB, "pytorchjob": PYTORCHJOB}.get(kind), name


def cancel(job_id: str, *, namespace: str = "default", api_client: ApiClient | None = None) -> None:
    """Delete the job and, in the background, its pods (propagationPolicy Background)."""
    resource, name = _split(job_id)
    api_client = api_client or connect()
    from kubernetes import client

    if resource is None:
        batch = client.BatchV1Api(api_client)
        _call(
            api_client,
            f"delete Job {name}",
            batch.delete_namespaced_job,
            name,
            namespace,
            propagation_policy="Background",
        )
    else:
        group, version, plural = resource
        custom = client.CustomObjectsApi(api_client)
        _call(
            api_client,
            f"delete {plural.removesuffix('s')} {name}",
            custom.delete_namespaced_custom_object,
            group,
            version,
            namespace,
            plural,
            name,
            propagation_policy="Background",
        )


def jobs(*, namespace: str = "default", api_client: ApiClient | None = None) -> list[EngineJob]:
    """Every job redline made in ``namespace`` (label app.kubernetes.io/managed-by=redline), oldest first: Jobs,
    and TrainJobs and PyTorchJobs where their operators are installed."""
    api_client = api_client or connect()
    from kubernetes import client

    batch = client.BatchV1Api(api_client)
    found = [
        job_state(job)
        for job in _call(api_client, "list Jobs", batch.list_namespaced_job, namespace, label_selector=SELECTOR).items
    ]
    custom = client.CustomObjectsApi(api_client)
    for group, version, plural in (TRAINJOB, PYTORCHJOB):
        listing = custom.list_namespaced_custom_object
        args = (group, version, namespace, plural)
        listed = _call(api_client, f"list {plural}", listing, *args, label_selector=SELECTOR, missing_ok=True)
        found.extend(custom_state(item) for item in (listed or {}).get("items", ()))
    return sorted(found, key=lambda job: (job.submitted_at or 0, job.id))


class Kubernetes(Engine):
    """A Kubernetes cluster (the current kubeconfig context, or the pod's service account), with the options of
    one submission: the image, the kind, the namespace, Kueue's priority class."""

    name = "kubernetes"
    options = ("image", "namespace", "kind", "priority_class")

    def __init__(
        self,
        *,
        image: str | None = None,
        namespace: str = "default",
        kind: str | None = None,
        priority_class: str | None = None,
    ) -> None:
        self.image, self.namespace = image, namespace
        self.kind, self.priority_class = kind, priority_class

    def _manifest_options(self) -> dict[str, Any]:
        if not self.image:
            raise BadInput("a Kubernetes job runs in a container image: give --image")
        given = {"kind": self.kind, "priority_class": self.priority_class}
        return {"image": self.image, "namespace": self.namespace} | {k: v for k, v in given.items() if v is not None}

    def render(self, spec: JobSpec) -> str:
        return render(spec, **self._manifest_options())

    def submit(self, spec: JobSpec) -> str:
        return submit(spec, **self._manifest_options())

    def jobs(self) -> list[EngineJob]:
        return jobs(namespace=self.namespace)

    def cancel(self, job_id: str) -> None:
        cancel(job_id, namespace=self.namespace)


def status(ids: Iterable[str], *, namespace: str = "default", api_client: ApiClient | None = None) -> list[EngineJob]:
    """The named jobs' states; a job that is gone is ``lost``."""
    wanted = [job_id.removeprefix("job/") for job_id in ids]
    for job_id in wanted:
        _split(job_id)
    known = {job.id: job for job in jobs(namespace=namespace, api_client=api_client)}
    return [
        known.get(job_id) or EngineJob("kubernetes", job_id, job_id, "lost", reason="not found") for job_id in wanted
    ]


# -- states --------------------------------------------------------------------------------------------------------


def _seconds(moment: datetime | str | None) -> float | None:
    if moment is None:
        return None
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment.replace("Z", "+00:00"))
    return moment.timestamp()


def job_state(job: V1Job) -> EngineJob:
    """A batch/v1 Job (the client's V1Job) as a row of `redline jobs`: Complete is done, Failed (or its
    FailureTarget, set while pods stop) failed, deleted cancelled, Suspended (Kueue has not admitted it) queued,
    a job with active pods running, one whose pods are not made yet queued."""
    meta, status_ = job.metadata, job.status
    if meta is None or meta.name is None:  # the API server names every object it lists
        raise RedlineError("Kubernetes listed a Job without a name")
    annotations = meta.annotations or {}
    conditions = {
        c.type: c for c in (status_.conditions if status_ and status_.conditions else ()) if c.status == "True"
    }
    ended = None
    if meta.deletion_timestamp is not None:
        state, reason = "cancelled", "deleted"
    elif "Complete" in conditions or "SuccessCriteriaMet" in conditions:
        condition = conditions.get("Complete") or conditions["SuccessCriteriaMet"]
        state, reason = "done", ""
        ended = (status_.completion_time if status_ else None) or condition.last_transition_time
    elif "Failed" in conditions or "FailureTarget" in conditions:
        condition = conditions.get("Failed") or conditions["FailureTarget"]
        state, reason, ended = "failed", condition.reason or condition.message or "", condition.last_transition_time
    elif "Suspended" in conditions or (job.spec is not None and job.spec.suspend):
        suspended = conditions.get("Suspended")
        state, reason = (
            "queued",
            (suspended.message if suspended and suspended.message else "suspended: waiting for Kueue"),
        )
    elif status_ and status_.active:
        state, reason = "running", f"{status_.active} pod{'s' if status_.active > 1 else ''} active"
    else:
        state, reason = "queued", "pods pending"
    return EngineJob(
        engine="kubernetes",
        id=meta.name,
        name=annotations.get(NAME_ANNOTATION, meta.name),
        state=state,
        exit_code=0 if state == "done" else None,
        reason=reason,
        user=annotations.get(USER_ANNOTATION, ""),
        submitted_at=_seconds(meta.creation_timestamp),
        started_at=_seconds(status_.start_time if status_ else None),
        ended_at=_seconds(ended),
    )


def custom_state(obj: Mapping[str, Any]) -> EngineJob:
    """A TrainJob or PyTorchJob, as the API returns it (a dict), as a row of `redline jobs`. Both report
    conditions: TrainJob's Complete / Failed / Suspended, PyTorchJob's Succeeded / Failed / Suspended / Running /
    Restarting; a TrainJob runs while its child Jobs have active pods."""
    meta, status_ = obj.get("metadata") or {}, obj.get("status") or {}
    annotations = meta.get("annotations") or {}
    conditions = {c["type"]: c for c in status_.get("conditions") or () if c.get("status") == "True"}
    kind = "trainjob" if obj.get("kind") == "TrainJob" else "pytorchjob"
    ended = None
    if meta.get("deletionTimestamp"):
        state, reason = "cancelled", "deleted"
    elif done := conditions.get("Complete") or conditions.get("Succeeded"):
        state, reason, ended = "done", "", done.get("lastTransitionTime")
    elif failed := conditions.get("Failed"):
        state, reason, ended = (
            "failed",
            failed.get("reason") or failed.get("message", ""),
            failed.get("lastTransitionTime"),
        )
    elif suspended := conditions.get("Suspended"):
        state, reason = "queued", suspended.get("message") or "suspended: waiting for Kueue"
    elif (
        "Running" in conditions
        or "Restarting" in conditions
        or any((job.get("active") or 0) > 0 for job in status_.get("jobsStatus") or ())
    ):
        state, reason = "running", "restarting" if "Restarting" in conditions else ""
    else:
        state, reason = "queued", "pods pending"
    return EngineJob(
        engine="kubernetes",
        id=f"{kind}/{meta.get('name', '')}",
        name=annotations.get(NAME_ANNOTATION, meta.get("name", "")),
        state=state,
        exit_code=0 if state == "done" else None,
        reason=reason,
        user=annotations.get(USER_ANNOTATION, ""),
        submitted_at=_seconds(meta.get("creationTimestamp")),
        started_at=_seconds(status_.get("startTime")),
        ended_at=_seconds(ended),
    )
