"""``trainscale export``: a trainscale checkpoint as a Hugging Face model directory, and such a directory's weights
loaded into a (sharded) model.

    from trainscale.export import export
    export("runs/version_0/checkpoints/last", "my-model")        # then AutoModelForCausalLM.from_pretrained("my-model")
    load_pretrained(sharded_model, "my-model")                  # each rank reads its shards' slices

Needs the ``hf`` extra (``pip install 'trainscale[hf]'``: transformers, safetensors). Guide: docs/huggingface.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainscale.export.hf import export, load_pretrained

__all__ = ["export", "load_pretrained"]


def __getattr__(name: str):
    if name in __all__:
        from trainscale.export import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'trainscale.export' has no attribute {name!r}")
