"""Loads torch.ops.megamoe (the C++ library built from python/csrc) and gives its forward op a
fake implementation, so that torch.compile can trace calls to it."""

import os
from pathlib import Path

import torch

_LIBRARY_NAME = "_megamoe_ops.so"


def _library_path() -> Path:
    override = os.environ.get("MEGAMOE_OPS_LIBRARY")
    if override:
        path = Path(override)
        if not path.is_file():
            raise ImportError(f"megamoe: MEGAMOE_OPS_LIBRARY={override} is not a file")
        return path
    path = Path(__file__).with_name(_LIBRARY_NAME)
    if not path.is_file():
        raise ImportError(
            f"megamoe: {path} is missing. Install the package (pip install --no-build-isolation .) or build "
            f"the library with CMake (target megamoe_torch_ops) and set MEGAMOE_OPS_LIBRARY to the "
            f"{_LIBRARY_NAME} it writes (build/python/megamoe/)."
        )
    return path


torch.ops.load_library(str(_library_path()))
ops = torch.ops.megamoe


@torch.library.register_fake("megamoe::forward")
def _forward_fake(layer, x, router_logits, topk_ids, topk_weights, deterministic, *routing):
    return torch.empty_like(x)


@torch.library.register_fake("megamoe::ep_forward")
def _ep_forward_fake(layer, x, topk_ids, topk_weights):
    return torch.empty_like(x)
