"""The registry of engines past the embedded queue (``queue.engines``): each engine one ``Engine`` class in its
own module, registered with the options it is made with; an unknown one refused in the one line ``--engine`` has
always given; each made from the CLI's options and rendering a job without a cluster (``--dry-run``)."""

from __future__ import annotations

import json

import pytest

from redline.capability import is_available
from redline.errors import BadInput
from redline.queue import engines
from redline.queue.engine import Engine
from redline.queue.kubernetes import Kubernetes
from redline.queue.ray_engine import RayEngine
from redline.queue.slurm import Slurm
from redline.queue.spec import JobSpec

SPEC = JobSpec(argv=("python", "train.py"), name="train", gpus=1, cwd="/work")
CLI_OPTIONS = {"image": None, "kind": None, "namespace": "default", "address": None}  # what `submit` passes


@pytest.mark.parametrize(
    ("name", "cls", "module", "options"),
    [
        ("slurm", Slurm, "redline.queue.slurm", ()),
        ("ray", RayEngine, "redline.queue.ray_engine", ("address",)),
        ("kubernetes", Kubernetes, "redline.queue.kubernetes", ("image", "namespace", "kind", "priority_class")),
    ],
)
def test_each_engine_is_one_class_in_its_module_registered_with_its_options(
    name: str, cls: type[Engine], module: str, options: tuple[str, ...]
) -> None:
    assert engines.ENGINES[name] is cls and issubclass(cls, Engine)
    assert (cls.name, cls.__module__, cls.options) == (name, module, options)


def test_the_engines_are_named_in_the_order_the_cli_lists_them() -> None:
    assert list(engines.ENGINES) == ["slurm", "ray", "kubernetes"]


@pytest.mark.parametrize("name", ["local", "warp", "Slurm", ""])
def test_an_unknown_engine_is_the_one_line_it_has_always_been(name: str) -> None:
    with pytest.raises(BadInput) as caught:
        engines.engine(name, **CLI_OPTIONS)
    assert str(caught.value) == f"--engine is local, slurm, ray, kubernetes; not {name!r}"


def test_each_engine_is_made_with_the_options_it_takes_and_the_defaults_of_those_not_given() -> None:
    kubernetes = engines.engine("kubernetes", **CLI_OPTIONS | {"image": "img:1", "address": "http://h:8265"})
    assert isinstance(kubernetes, Kubernetes)
    assert (kubernetes.image, kubernetes.namespace, kubernetes.kind, kubernetes.priority_class) == (
        "img:1",
        "default",
        None,
        None,
    )
    ray = engines.engine("ray", **CLI_OPTIONS | {"address": "http://head:8265", "image": "img:1"})
    assert isinstance(ray, RayEngine) and ray.address == "http://head:8265" and not ray.upload_working_dir
    assert isinstance(engines.engine("slurm", **CLI_OPTIONS | {"image": "img:1"}), Slurm)


def test_slurm_and_ray_render_a_job_without_a_cluster() -> None:
    script = engines.engine("slurm").render(SPEC)
    assert script.startswith("#!/bin/bash\n") and "#SBATCH --job-name=train" in script
    rendered = json.loads(engines.engine("ray", address="http://head:8265").render(SPEC))
    assert rendered["address"] == "http://head:8265"
    assert rendered["submit_job"]["entrypoint"] == "cd /work && exec python train.py"


def test_kubernetes_needs_an_image_before_anything_is_rendered() -> None:
    with pytest.raises(BadInput) as caught:
        engines.engine("kubernetes", **CLI_OPTIONS).render(SPEC)
    assert str(caught.value) == "a Kubernetes job runs in a container image: give --image"


@pytest.mark.skipif(not is_available("kubernetes"), reason="needs the kubernetes client (the manifest's check)")
def test_kubernetes_renders_the_kind_and_namespace_it_was_made_with() -> None:
    import yaml

    made = engines.engine("kubernetes", image="img:1", namespace="team", kind="pytorchjob", priority_class="high")
    manifest = yaml.safe_load(made.render(SPEC))
    assert (manifest["kind"], manifest["metadata"]["namespace"]) == ("PyTorchJob", "team")
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
