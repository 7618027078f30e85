"""Triton kernels for tree verification over paged KV; `reference` holds the plain-torch oracle.

The kernel modules load lazily (PEP 562), so `from ddtree_kernels import reference` needs no Triton and does
not fix Triton's interpreter mode before a test module has chosen it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SplitConfig": "ddtree_kernels.split_kv",
    "commit_kv": "ddtree_kernels.commit_kv",
    "draft_block_attention": "ddtree_kernels.draft_attention",
    "hybrid_verify_attention": "ddtree_kernels.verify_attention",
    "latent_verify_attention": "ddtree_kernels.latent_verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ddtree_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    # NOTE: the import just bound the same-named submodule here (ddtree_kernels.commit_kv); the function wins.
    # Code that imports the submodule itself first sees the module: import from the submodule then.
    globals()[name] = value
    return value
