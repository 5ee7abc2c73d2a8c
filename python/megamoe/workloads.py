"""The named workloads (src/plan/workloads.cpp): the MoE layers megamoe is measured on; and a layer of
the user's own shape, "experts=E,top_k=K,hidden=H,intermediate=I", as megamoe-bench takes it."""

from dataclasses import dataclass

from megamoe.routing import DeepseekRouting, Routing, SoftmaxRouting


@dataclass(frozen=True)
class Workload:
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    routing: Routing
    description: str


WORKLOADS = {
    "qwen35-a3b": Workload(256, 8, 2048, 512, SoftmaxRouting(renormalize=True), "Qwen3.5-A3B-like"),
    "qwen3-30b-a3b": Workload(128, 8, 2048, 768, SoftmaxRouting(renormalize=True), "Qwen3-30B-A3B"),
    "dsv3": Workload(256, 8, 7168, 2048,
                     DeepseekRouting(n_group=8, topk_group=4, routed_scaling_factor=2.5, renormalize=True),
                     "DeepSeek-V3 routed experts"),
}

SHAPE_FORM = "experts=E,top_k=K,hidden=H,intermediate=I"
SHAPE_EXAMPLE = "experts=8,top_k=2,hidden=4096,intermediate=14336"
_SHAPE_KEYS = ("experts", "top_k", "hidden", "intermediate")


def find_workload(name: str) -> Workload:
    """A named workload, or a layer of the given shape (every key once, in any order; softmax
    routing with renormalized weights, as Mixtral and Qwen route). Raises ValueError saying what a
    shape lacks, or listing the names; the values are the layer's to judge (prepare_weights)."""
    if "=" not in name:
        if name in WORKLOADS:
            return WORKLOADS[name]
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}, or a shape such as "
                         f"{SHAPE_EXAMPLE}")

    def refuse(why: str) -> ValueError:
        return ValueError(f"workload {name!r}: {why}; a layer of your own shape is written {SHAPE_FORM} "
                          f"(e.g. {SHAPE_EXAMPLE})")

    values = {}
    for item in name.split(","):
        key, equals, value = item.partition("=")
        if not equals:
            raise refuse(f"{item!r} is not key=value")
        if key not in _SHAPE_KEYS:
            raise refuse(f"unknown key {key!r}")
        if key in values:
            raise refuse(f"{key} given twice")
        if not (value.isascii() and value.isdigit()) or len(value) > 9:
            raise refuse(f"{key} needs a non-negative integer of at most 9 digits, got {value!r}")
        values[key] = int(value)
    missing = [key for key in _SHAPE_KEYS if key not in values]
    if missing:
        raise refuse(f"no {', '.join(missing)}")
    return Workload(values["experts"], values["top_k"], values["hidden"], values["intermediate"],
                    SoftmaxRouting(renormalize=True), "a layer of the user's shape")
