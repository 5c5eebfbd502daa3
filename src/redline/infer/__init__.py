"""`redline infer`: make a trained model serve fast on this server, each way of running it measured and checked.

``models`` turns a SPEC into one module with one tensor in and one out; ``backends`` are the ways to run it
(eager, torch.compile, AOTInductor, ONNX Runtime, TensorRT, int8); ``measure`` times each at each batch size
and checks its outputs against eager fp32; ``generate`` times a decoder's prefill and decode with a static KV
cache; ``artifact`` saves the pick and ``load`` (here) reads it back::

    from redline.infer import load
    model = load("best/")
    logits = model(batch)
"""

from __future__ import annotations

from typing import Any


def load(path: Any, device: str | None = None) -> Any:
    """The artifact ``redline infer -o PATH`` saved, as a callable (``redline.infer.artifact.Artifact``)."""
    from redline.infer.artifact import load as load_artifact

    return load_artifact(path, device)
