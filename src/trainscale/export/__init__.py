"""``trainscale export``: a trainscale checkpoint as a Hugging Face model directory.

    from trainscale.export import export
    export("runs/version_0/checkpoints/last", "my-model")        # then AutoModelForCausalLM.from_pretrained("my-model")

Needs the ``hf`` extra (``pip install 'trainscale[hf]'``: transformers, safetensors). Guide: docs/huggingface.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainscale.export.hf import export

__all__ = ["export"]


def __getattr__(name: str):
    if name == "export":
        from trainscale.export.hf import export

        return export
    raise AttributeError(f"module 'trainscale.export' has no attribute {name!r}")
