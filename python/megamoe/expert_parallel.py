"""The MoE layer expert-parallel across the GPUs of one node, from PyTorch: one process per GPU,
each holding E / world_size of the experts (rank r the contiguous slice [r * E / world,
(r + 1) * E / world), vLLM's linear placement). ep_fused_moe sends each of this rank's tokens to
the ranks that own its experts over NVLink, runs them there, and sums the results back in rank
order: y for this rank's tokens, as if one GPU held every expert. Routing is precomputed (global
topk_ids and topk_weights, as the caller's router gives them).

Every call is collective: each rank calls prepare_ep_weights, ep_fused_moe (with its own token
count, 0 included) and close in the same order. A rank that does not arrive (stalled or dead)
does not hang the others: their device-side barrier gives up after ~10 s with a diagnostic, the
outputs of that call and later ones are NaN, and EpMoeWeights.check_peers() raises naming the
rank; the process and its CUDA context stay usable. Several ranks may share one GPU (each its own
process), which is how the multi-rank code is tested on one GPU.
"""

import os
import tempfile
from typing import Optional, Union

import torch

from megamoe._ops import ops
from megamoe.layer import (LayerHandle, check_precomputed, checked_tokens, checked_weights, device_index,
                           ids_as_int32, packed_on, require_int, require_str)
from megamoe.routing import PrecomputedRouting, op_arguments

# prepare_ep_weights calls in this process so far: each layer gets its own folder under the
# rendezvous folder (every bootstrap name is used once per folder), numbered alike on every rank
# because the calls are collective.
_layers_made = 0


class EpMoeWeights(LayerHandle):
    """This rank's share of an expert-parallel layer (from prepare_ep_weights): its experts on one
    GPU, the symmetric buffer the ranks exchange rows through, and the workspace for up to
    `max_tokens` tokens per rank and call. Freeing it is collective (close(), or the garbage
    collector, or the process's exit): a rank that lets go while its peers keep theirs waits up to
    a minute for them. Its repr says how it was built: token_rows as they travel ("automatic"
    resolved), partial_sums, symmetric_memory, launch and combine, and for fp8_tensor where its
    activation scales come from (input_scales: "from_checkpoint" or "dynamic")."""

    def __init__(self, *, rank: int, world_size: int, token_rows: str, partial_sums: str, symmetric_memory: str,
                 launch: str, combine: str, input_scales: Optional[str] = None, **layer):
        super().__init__(**layer)
        self.input_scales = input_scales
        self.rank = rank
        self.world_size = world_size
        self.token_rows = token_rows
        self.partial_sums = partial_sums
        self.symmetric_memory = symmetric_memory
        self.launch = launch
        self.combine = combine

    @property
    def experts(self) -> range:
        """The global ids of the experts this rank holds."""
        per_rank = self.num_experts // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def close(self) -> None:
        """Collective: frees the layer on every rank at the same point."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._destroy(handle)

    def _destroy(self, handle: int) -> None:
        ops.destroy_ep_layer(handle)

    def invalid_routing_ids(self) -> int:
        """How many ids this rank's calls routed that were >= num_experts, negative other than -1 or
        repeated within a token since the last call; they contributed nothing. Synchronizes the
        current stream."""
        return ops.ep_invalid_routing_ids(self._live_handle())

    def check_peers(self) -> None:
        """Raises RuntimeError when a peer rank stalled or died: a cross-rank barrier of an earlier
        call waited past its timeout (10 s) and gave up, naming the barrier and the rank. From then
        on that call's and later calls' outputs are NaN and ep_fused_moe raises; the process and
        its CUDA context stay usable. Synchronizes the current stream."""
        ops.ep_check_peers(self._live_handle())

    def _live_handle(self) -> int:
        if self._handle is None:
            raise ValueError("megamoe: this expert-parallel layer was closed")
        return self._handle

    def __repr__(self) -> str:
        scales = "" if self.input_scales is None else f", input_scales={self.input_scales!r}"
        return (f"EpMoeWeights(num_experts={self.num_experts}, experts={self.experts}, top_k={self.top_k}, "
                f"hidden={self.hidden}, intermediate={self.intermediate}, precision={self.precision!r}{scales}, "
                f"max_tokens={self.max_tokens}, rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"token_rows={self.token_rows!r}, partial_sums={self.partial_sums!r}, "
                f"symmetric_memory={self.symmetric_memory!r}, launch={self.launch!r}, combine={self.combine!r})")


def _rank_and_world(rank: Optional[int], world_size: Optional[int]):
    """The caller's rank and world size; what the caller left out from torch.distributed, else from
    the launcher's RANK and WORLD_SIZE."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        launched = torch.distributed.get_rank(), torch.distributed.get_world_size()
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        launched = _launcher_int("RANK"), _launcher_int("WORLD_SIZE")
    else:
        raise ValueError("megamoe: pass rank and world_size, initialize torch.distributed, or launch with RANK and "
                         "WORLD_SIZE set (torchrun, megamoe-run)")
    return (launched[0] if rank is None else rank), (launched[1] if world_size is None else world_size)


def _launcher_int(variable: str) -> int:
    """The integer a launcher (torchrun, megamoe-run) put in the environment variable `variable`."""
    value = os.environ[variable]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"megamoe: the environment variable {variable}={value!r} must be an integer (torchrun and "
                         f"megamoe-run set RANK and WORLD_SIZE; or pass rank and world_size)") from None


def _folder_name(folder, name: str) -> Optional[str]:
    """`folder` (a str or os.PathLike, or None) as a str; TypeError for anything else."""
    if folder is None:
        return None
    path = os.fspath(folder) if isinstance(folder, os.PathLike) else folder
    if not isinstance(path, str):
        raise TypeError(f"megamoe: {name} must be a folder's path (str or os.PathLike), not "
                        f"{type(folder).__name__} {folder!r}")
    return path


def _rendezvous_root(rendezvous_dir: Optional[str]) -> str:
    """A folder every rank of this node shares: the caller's, megamoe-run's MEGAMOE_RENDEZVOUS_DIR,
    or one rank 0 makes and torch.distributed broadcasts."""
    if rendezvous_dir is not None:
        return rendezvous_dir
    if os.environ.get("MEGAMOE_RENDEZVOUS_DIR"):
        return os.environ["MEGAMOE_RENDEZVOUS_DIR"]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        folder = [tempfile.mkdtemp(prefix="megamoe-ep-") if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(folder, src=0)
        return folder[0]
    raise ValueError("megamoe: the ranks meet in a shared folder: pass rendezvous_dir, set MEGAMOE_RENDEZVOUS_DIR, "
                     "or initialize torch.distributed")


def prepare_ep_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    num_experts: int,
    top_k: int,
    precision: str = "fp8_block",
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w13_input_scale: Optional[torch.Tensor] = None,
    w2_input_scale: Optional[torch.Tensor] = None,
    scale_format: str = "fp32",
    max_tokens: int = 4096,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    rendezvous_dir: Optional[str] = None,
    device: Optional[Union[torch.device, str, int]] = None,
    token_rows: str = "automatic",
    partial_sums: str = "bf16",
    symmetric_memory: str = "cuda_ipc",
    launch: str = "staged",
    combine: str = "owner_sums",
) -> EpMoeWeights:
    """Collective: packs this rank's experts (w13 [E / world, 2I, H], w2 [E / world, H, I], in
    prepare_weights' layouts, dtypes and scales) and joins the other ranks' shares into a layer
    of num_experts experts for up to max_tokens tokens per rank and call, on `device` (default:
    the current CUDA device, one per rank). rank and world_size come from the arguments,
    torch.distributed, or RANK / WORLD_SIZE. The ranks meet in a folder they share: rendezvous_dir,
    else MEGAMOE_RENDEZVOUS_DIR (megamoe-run sets it), else one rank 0 makes and torch.distributed
    broadcasts. top_k may not exceed the experts per rank. Precision fp8_tensor takes this rank's
    w13_input_scale and w2_input_scale as prepare_weights does (one per layer, or one per local
    expert, of which the largest is used, as vLLM's loader does for a rank's slice): each owner
    encodes the bf16 rows it receives with its own scales, so ranks whose scales differ compute with
    different codes; without them (dynamic) each owner's scales come from the rows it received and
    its own FC1 output, not from the whole batch of every rank (docs/usage.md#expert-parallelism).
    token_rows: how token rows travel to their experts' owners, "automatic" (fp8 for fp8_block,
    bf16 for bf16 and fp8_tensor), "bf16", or "fp8" (fp8_block:
    quantized once at their source by the layer's own rule, half the bytes, the same output bit
    for bit). partial_sums: how each owner's partial sums travel back, "bf16" or "fp8" (quantized
    once per 128 channels by their owner, half the bytes; not bf16's bits: a relative L2 difference
    of about 1-2% from the bf16 result where half the experts are remote; hidden a multiple of
    128). symmetric_memory: where the buffer the ranks exchange rows through lives, "cuda_ipc"
    (one node) or "nvshmem" (NVSHMEM's symmetric heap, a build with NVSHMEM; the same on every
    rank; NVSHMEM allows one job per process, so every NVSHMEM layer of a process must be shared
    by the same ranks, and not beside another user of NVSHMEM such as PyTorch's NVSHMEM symmetric
    memory). launch: "staged" (dispatch, the local experts and the combine as separate launches) or
    "fused" (each rank's forward as one launch, designed to give the staged output bit for bit,
    with either partial_sums; with the default token_rows; bf16 and fp8_block only; correct on one
    GPU with ranks sharing it, with either combine, not yet measured on two:
    docs/design.md#expert-parallelism-inside-the-persistent-kernel). combine: how a fused layer's
    owners return their experts' outputs, "owner_sums" (each owner sums its experts' rows of a
    token and sends that partial sum, as partial_sums says; the source adds the owners' sums in rank
    order: the staged layer's output bit for bit) or "fc2_stores" (FC2's epilogue stores each
    expert's bf16 output row straight into its token's source rank, which sums the token's k rows in
    slot order: the single-GPU layer's output bit for bit, about 1e-3 relative L2 from the staged
    layer's, which rounds each owner's partial sum to bf16; up to k rows a token cross NVLink instead
    of one per owner, and the owners have no combine phase; launch="fused" with partial_sums="bf16"
    only).
    """
    # Every call takes the next layer number, refused or not: a refusal on some ranks only (a NaN in
    # this rank's experts) would otherwise leave the ranks' numbers, and so their folders, apart
    # for every later layer.
    global _layers_made
    layer_number = _layers_made
    _layers_made += 1
    require_str(precision, "precision")
    if require_str(token_rows, "token_rows") not in ("automatic", "bf16", "fp8"):
        raise ValueError(f"megamoe: token_rows={token_rows!r} must be 'automatic', 'bf16' or 'fp8'")
    if require_str(partial_sums, "partial_sums") not in ("bf16", "fp8"):
        raise ValueError(f"megamoe: partial_sums={partial_sums!r} must be 'bf16' or 'fp8'")
    if require_str(symmetric_memory, "symmetric_memory") not in ("cuda_ipc", "nvshmem"):
        raise ValueError(f"megamoe: symmetric_memory={symmetric_memory!r} must be 'cuda_ipc' or 'nvshmem'")
    if require_str(launch, "launch") not in ("staged", "fused"):
        raise ValueError(f"megamoe: launch={launch!r} must be 'staged' or 'fused'")
    if require_str(combine, "combine") not in ("owner_sums", "fc2_stores"):
        raise ValueError(f"megamoe: combine={combine!r} must be 'owner_sums' or 'fc2_stores'")
    if combine == "fc2_stores" and launch != "fused":
        raise NotImplementedError("megamoe: combine='fc2_stores' is the fused forward's (FC2's epilogue stores into "
                                  "the sources): set launch='fused', or keep combine='owner_sums' for the staged layer")
    if combine == "fc2_stores" and partial_sums == "fp8":
        raise NotImplementedError("megamoe: combine='fc2_stores' returns each expert's bf16 row as FC2 stores it: "
                                  "partial_sums='fp8' is for combine='owner_sums'")
    if launch == "fused" and precision == "fp8_tensor":
        raise NotImplementedError("megamoe: launch='fused' takes precision bf16 or fp8_block (the single-kernel "
                                  "forward has no fp8_tensor path); an fp8_tensor layer runs staged (launch='staged')")
    if launch == "fused" and token_rows != "automatic":
        raise NotImplementedError(f"megamoe: launch='fused' takes token_rows='automatic' (the rows its layer computes "
                                  f"on), not {token_rows!r}")
    if token_rows == "fp8" and precision != "fp8_block":
        raise ValueError(f"megamoe: token_rows='fp8' needs precision 'fp8_block' (the layer's own quantization "
                         f"of x), not {precision!r}")
    rendezvous_dir = _folder_name(rendezvous_dir, "rendezvous_dir")
    checked = checked_weights(w13, w2, w13_scale, w2_scale, precision, w13_input_scale, w2_input_scale)
    # The op refuses it too, but only once the device was looked for and the weights packed.
    if partial_sums == "fp8" and checked.hidden % 128:
        raise NotImplementedError(f"megamoe: partial_sums='fp8' quantizes per 128 channels: hidden={checked.hidden} "
                                  f"is not a multiple of 128")
    rank, world_size = _rank_and_world(rank, world_size)
    # The op checks them too, but only once the device was looked for and the weights packed.
    if require_int(world_size, "world_size") < 1:
        raise ValueError(f"megamoe: world_size={world_size} is out of range: it must be >= 1")
    if not 0 <= require_int(rank, "rank") < world_size:
        raise ValueError(f"megamoe: rank {rank} must be in [0, world_size={world_size})")
    if require_int(num_experts, "num_experts") != checked.num_experts * world_size:
        raise ValueError(f"megamoe: this rank's w13 holds {checked.num_experts} experts, so num_experts must be "
                         f"{checked.num_experts} x {world_size} ranks = {checked.num_experts * world_size}, "
                         f"not {num_experts!r}")
    if not 1 <= require_int(top_k, "top_k") <= checked.num_experts:
        raise ValueError(f"megamoe: top_k must be an int in [1, {checked.num_experts}] (the experts per rank: a "
                         f"rank runs every local expert of a token it receives), not {top_k!r}")
    # The layer each rank runs on its GPU, of this rank's experts: what the kernels' limits apply to
    # (the whole layer's checks are the same, or weaker).
    ops.check_layer(checked.num_experts, checked.hidden, checked.intermediate, top_k,
                    require_str(precision, "precision"),
                    require_str(scale_format, "scale_format"), *op_arguments(PrecomputedRouting()),
                    require_int(max_tokens, "max_tokens"), 0, "auto", 0, "auto")
    checked.require_finite()
    folder = _rendezvous_root(rendezvous_dir)
    device = torch.device("cuda", ops.check_device(device_index(device)))
    packed = packed_on(checked, precision, scale_format, device)
    layer_folder = os.path.join(folder, f"megamoe-ep-layer-{layer_number}")
    os.makedirs(layer_folder, exist_ok=True)
    handle = ops.create_ep_layer(*packed, num_experts, checked.hidden, checked.intermediate, top_k, precision,
                                 scale_format, max_tokens, layer_folder, rank, world_size, device.index, token_rows,
                                 partial_sums, symmetric_memory, launch, combine)
    return EpMoeWeights(handle=handle, num_experts=num_experts, top_k=top_k, hidden=checked.hidden,
                        intermediate=checked.intermediate, precision=precision, scale_format=scale_format,
                        max_tokens=max_tokens, rank=rank, world_size=world_size, device=device,
                        token_rows=ops.ep_token_rows(handle), partial_sums=partial_sums,
                        symmetric_memory=symmetric_memory, launch=launch, combine=combine,
                        input_scales=checked.input_scales(precision))


def ep_fused_moe(x: torch.Tensor, weights: EpMoeWeights, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
    """Collective: y [T, H] bfloat16 for this rank's x [T, H] bfloat16 (T <= max_tokens, 0 too),
    routed by topk_ids [T, k] (int32 or int64 global expert ids; -1: not routed) and topk_weights
    [T, k] (float). Enqueues on the current stream without host synchronization (a CUDA graph can
    hold it, captured alike on every rank)."""
    if not isinstance(weights, EpMoeWeights):
        raise TypeError(f"megamoe: weights must come from megamoe.prepare_ep_weights, not {type(weights).__name__}")
    handle = weights._live_handle()
    tokens = checked_tokens(x, weights.hidden, weights.device)
    check_precomputed(topk_ids, topk_weights, tokens, weights.top_k, weights.device)
    if tokens > weights.max_tokens:
        # Unlike fused_moe, not cut into passes: the ranks would need as many passes each.
        raise ValueError(f"megamoe: {tokens} tokens exceed the {weights.max_tokens} per rank the weights were "
                         f"prepared for (max_tokens)")
    return ops.ep_forward(handle, x, ids_as_int32(topk_ids), topk_weights.to(torch.float32))


__all__ = ["EpMoeWeights", "prepare_ep_weights", "ep_fused_moe"]
