"""megamoe.expert_parallel without GPUs: the checks that come before anything collective, and the
fake op torch.compile traces with. The layer itself runs on two GPUs in ep_two_ranks.py (CTest
python.gpu2)."""

import os
import types

import pytest
import torch

import megamoe
from megamoe import expert_parallel

W13 = torch.zeros(4, 256, 128, dtype=torch.bfloat16)  # this rank's 4 experts, I = H = 128
W2 = torch.zeros(4, 128, 128, dtype=torch.bfloat16)


def test_prepare_ep_weights_checks_before_joining_the_other_ranks(monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MEGAMOE_RENDEZVOUS_DIR", raising=False)
    with pytest.raises(ValueError, match="pass rank and world_size"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2)
    ranks = dict(rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"num_experts must be 4 x 2 ranks = 8, not 16"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=16, top_k=2, **ranks)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, 4\] \(the experts per rank"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=5, **ranks)
    with pytest.raises(ValueError, match="max_tokens"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, max_tokens=0, **ranks)
    with pytest.raises(ValueError, match="precision"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, precision="fp4", **ranks)
    with pytest.raises(ValueError, match="shared folder"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, **ranks)
    with pytest.raises(ValueError, match="token_rows='fp16' must be 'automatic', 'bf16' or 'fp8'"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, token_rows="fp16", **ranks)
    with pytest.raises(ValueError, match="token_rows='fp8' needs precision 'fp8_block'"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, precision="bf16", token_rows="fp8", **ranks)
    with pytest.raises(ValueError, match="partial_sums='fp16' must be 'bf16' or 'fp8'"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, partial_sums="fp16", **ranks)
    with pytest.raises(ValueError, match="symmetric_memory='ipc' must be 'cuda_ipc' or 'nvshmem'"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, symmetric_memory="ipc", **ranks)
    # The rank and world size, and the kernels' limits, are checked before the device is looked for
    # (the op refused them only after it, on a GPU once the weights were packed).
    folder = dict(rendezvous_dir=str(tmp_path))
    for rank in (2, -1):
        with pytest.raises(ValueError, match=rf"rank {rank} must be in \[0, world_size=2\)"):
            megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, rank=rank, world_size=2, **folder)
    with pytest.raises(ValueError, match=r"world_size=0 is out of range: it must be >= 1"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=0, top_k=2, rank=0, world_size=0, **folder)
    with pytest.raises(TypeError, match="world_size must be an int, not str '2'"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, rank=0, world_size="2", **folder)
    with pytest.raises(TypeError, match="rank must be an int, not float 1.0"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, rank=1.0, world_size=2, **folder)
    per_rank = dict(w13=W13[:1].expand(520, 256, 128), w2=W2[:1].expand(520, 128, 128))
    with pytest.raises(NotImplementedError, match="num_experts=520 exceeds the 512 the routing kernel holds"):
        megamoe.prepare_ep_weights(**per_rank, num_experts=1040, top_k=2, **ranks, **folder)
    with pytest.raises(NotImplementedError, match="top_k=33 exceeds the 32 slots per token"):
        megamoe.prepare_ep_weights(per_rank["w13"][:64], per_rank["w2"][:64], num_experts=128, top_k=33, **ranks,
                                   **folder)
    # The launcher's variables, as megamoe-run and torchrun set them, are enough to get past these.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MEGAMOE_RENDEZVOUS_DIR", str(tmp_path))
    assert expert_parallel._rank_and_world(None, None) == (1, 2)
    assert expert_parallel._rank_and_world(0, None) == (0, 2)
    assert expert_parallel._rendezvous_root(None) == str(tmp_path)


def ep_weights(**overrides) -> megamoe.EpMoeWeights:
    """A handle naming no layer (closing it is a no-op), on the CPU so that the checks can run."""
    fields = dict(handle=-1, num_experts=8, top_k=2, hidden=128, intermediate=128, precision="bf16",
                  scale_format="fp32", max_tokens=16, rank=1, world_size=2, device=torch.device("cpu"),
                  token_rows="bf16", partial_sums="bf16", symmetric_memory="cuda_ipc", launch="staged",
                  combine="owner_sums")
    fields.update(overrides)
    return megamoe.EpMoeWeights(**fields)


def test_the_repr_says_how_the_layer_was_built():
    text = repr(ep_weights(precision="fp8_block", token_rows="fp8", partial_sums="fp8", symmetric_memory="nvshmem",
                           launch="fused"))
    for part in ("precision='fp8_block'", "experts=range(4, 8)", "rank=1, world_size=2", "token_rows='fp8'",
                 "partial_sums='fp8'", "symmetric_memory='nvshmem'", "launch='fused'", "combine='owner_sums'"):
        assert part in text, text
    text = repr(ep_weights(launch="fused", combine="fc2_stores"))
    assert "launch='fused', combine='fc2_stores'" in text, text
    assert "input_scales" not in text
    text = repr(ep_weights(precision="fp8_tensor", input_scales="dynamic"))
    assert "precision='fp8_tensor', input_scales='dynamic'" in text, text


def test_ep_fused_moe_checks_its_arguments():
    weights = ep_weights()
    assert weights.experts == range(4, 8)
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    routing_weights = torch.zeros(3, 2)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        megamoe.ep_fused_moe(x.float(), weights, ids, routing_weights)
    with pytest.raises(TypeError, match="topk_ids must be int32 or int64"):
        megamoe.ep_fused_moe(x, weights, ids.float(), routing_weights)
    with pytest.raises(ValueError, match=r"topk_weights must be \[3, 2\]"):
        megamoe.ep_fused_moe(x, weights, ids, routing_weights[:2])
    with pytest.raises(ValueError, match="must be contiguous"):
        megamoe.ep_fused_moe(x, weights, ids.t().contiguous().t(), routing_weights)
    with pytest.raises(ValueError, match="17 tokens exceed the 16 per rank"):
        megamoe.ep_fused_moe(torch.zeros(17, 128, dtype=torch.bfloat16), weights, torch.zeros(17, 2, dtype=torch.int32),
                             torch.zeros(17, 2))
    with pytest.raises(TypeError, match="prepare_ep_weights"):
        megamoe.ep_fused_moe(x, object(), ids, routing_weights)
    weights.close()
    with pytest.raises(ValueError, match="was closed"):
        megamoe.ep_fused_moe(x, weights, ids, routing_weights)
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle

        pickle.dumps(ep_weights())


def test_ep_forward_has_a_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 128, dtype=torch.bfloat16, device="cuda")
        y = torch.ops.megamoe.ep_forward(-1, x, torch.empty(5, 2, dtype=torch.int32, device="cuda"),
                                         torch.empty(5, 2, device="cuda"))
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.device == x.device


def test_ep_ops_refuse_bad_arguments_before_any_rendezvous():
    """Without a GPU: the op's own checks (for callers of torch.ops.megamoe directly)."""
    empty = torch.empty(0, dtype=torch.uint8)
    scales = torch.empty(0)
    good = dict(num_experts=8, hidden=128, top_k=2, precision="bf16", rank=0, world_size=2, token_rows="automatic",
                partial_sums="bf16", symmetric_memory="cuda_ipc", launch="staged", combine="owner_sums")

    def create(**changes):
        a = dict(good, **changes)
        # combine=None leaves it out, for the schema's default.
        combine = () if a["combine"] is None else (a["combine"],)
        torch.ops.megamoe.create_ep_layer(empty, scales, empty, scales, scales, a["num_experts"], a["hidden"], 128,
                                          a["top_k"], a["precision"], "fp32", 16, "/nowhere", a["rank"], a["world_size"], 0,
                                          a["token_rows"], a["partial_sums"], a["symmetric_memory"], a["launch"],
                                          *combine)

    refusals = [
        (dict(world_size=3), ValueError, "must be a multiple of the world size 3"),
        (dict(rank=2), ValueError, r"rank 2 must be in \[0, world_size=2\)"),
        (dict(), ValueError, "packed w13 must be contiguous with"),
        (dict(token_rows="fp16"), ValueError, "token_rows must be 'automatic', 'bf16' or 'fp8', not 'fp16'"),
        (dict(token_rows="fp8"), ValueError, "token_rows='fp8' needs precision fp8_block"),
        (dict(partial_sums="fp16"), ValueError, "partial_sums must be 'bf16' or 'fp8', not 'fp16'"),
        (dict(hidden=192, partial_sums="fp8"), NotImplementedError, "hidden=192 is not a multiple of 128"),
        (dict(symmetric_memory="shm"), ValueError, "symmetric_memory must be 'cuda_ipc' or 'nvshmem', not 'shm'"),
        (dict(launch="single_kernel"), ValueError, "launch must be 'staged' or 'fused', not 'single_kernel'"),
        (dict(launch="fused", token_rows="bf16"), NotImplementedError, "launch='fused' takes token_rows='automatic'"),
        (dict(launch="fused", precision="fp8_tensor"), NotImplementedError, "an fp8_tensor layer runs staged"),
        # Taken (FP8 partial sums in one launch): refused only later, for the empty weights.
        (dict(launch="fused", partial_sums="fp8"), ValueError, "packed w13 must be contiguous with"),
        (dict(num_experts=128, top_k=33), NotImplementedError, "top_k=33 exceeds the 32 slots per token"),
        (dict(combine="sum"), ValueError, "combine must be 'owner_sums' or 'fc2_stores', not 'sum'"),
        (dict(combine="fc2_stores"), NotImplementedError,
         "combine='fc2_stores' is the fused forward's .* set launch='fused'"),
        (dict(combine="fc2_stores", launch="fused", partial_sums="fp8"), NotImplementedError,
         "partial_sums='fp8' is for combine='owner_sums'"),
        # Taken (FC2 storing into the sources; left out, owner_sums): refused only later, for the
        # empty weights.
        (dict(combine="fc2_stores", launch="fused"), ValueError, "packed w13 must be contiguous with"),
        (dict(combine=None), ValueError, "packed w13 must be contiguous with"),
    ]
    for changes, error, message in refusals:
        with pytest.raises(error, match=message):
            create(**changes)
    with pytest.raises(ValueError, match="no expert-parallel layer with handle"):
        torch.ops.megamoe.ep_invalid_routing_ids(10**9)
    with pytest.raises(ValueError, match="no expert-parallel layer with handle"):
        torch.ops.megamoe.ep_check_peers(10**9)


def test_the_layer_limit_is_per_rank(monkeypatch, tmp_path):
    """1024 experts over 2 ranks: 512 on each GPU, which the kernels hold; the checks pass and the
    device is looked for (here a stand-in that stops there)."""
    class Stop(Exception):
        pass

    def check_device(index):
        raise Stop

    monkeypatch.setattr(expert_parallel, "ops", type("Ops", (), dict(
        check_layer=staticmethod(torch.ops.megamoe.check_layer), check_device=staticmethod(check_device))))
    with pytest.raises(Stop):
        megamoe.prepare_ep_weights(W13[:1].expand(512, 256, 128), W2[:1].expand(512, 128, 128), num_experts=1024,
                                   top_k=2, rank=0, world_size=2, rendezvous_dir=str(tmp_path))


@pytest.mark.parametrize("changes, error, message", [
    # A bool was an int, and a float a bad value.
    (dict(top_k=True), TypeError, "top_k must be an int, not bool True"),
    (dict(num_experts=8.0), TypeError, "num_experts must be an int, not float 8.0"),
    (dict(rendezvous_dir=5), TypeError, r"rendezvous_dir must be a folder's path \(str or os.PathLike\), not int 5"),
    (dict(rendezvous_dir=b"/tmp"), TypeError, "rendezvous_dir must be a folder's path"),
    # Refused by the op, but only once the device was looked for and the weights packed.
    (dict(w13=torch.zeros(4, 128, 192, dtype=torch.bfloat16), w2=torch.zeros(4, 192, 64, dtype=torch.bfloat16),
          precision="bf16", partial_sums="fp8"), NotImplementedError,
     "partial_sums='fp8' quantizes per 128 channels: hidden=192 is not a multiple of 128"),
    (dict(w2=torch.cat([W2[:3], torch.full((1, 128, 128), float("nan"), dtype=torch.bfloat16)])), ValueError,
     r"w2\[3, 0, 0\] = nan: weights must be finite"),
    (dict(launch="one_kernel"), ValueError, "launch='one_kernel' must be 'staged' or 'fused'"),
    (dict(launch=True), TypeError, "launch must be a str"),
    (dict(launch="fused", token_rows="bf16"), NotImplementedError,
     "launch='fused' takes token_rows='automatic' .the rows its layer computes on., not 'bf16'"),
    # Compared with the token rows' before its type was checked: "needs precision 'fp8_block', not None".
    (dict(precision=None, token_rows="fp8"), TypeError, "precision must be a str, not NoneType None"),
    (dict(combine=1), TypeError, "combine must be a str, not int 1"),
    (dict(combine="sum"), ValueError, "combine='sum' must be 'owner_sums' or 'fc2_stores'"),
    (dict(combine="fc2_stores"), NotImplementedError,
     "combine='fc2_stores' is the fused forward's .*: set launch='fused', or keep combine='owner_sums'"),
    (dict(combine="fc2_stores", launch="fused", partial_sums="fp8"), NotImplementedError,
     "combine='fc2_stores' returns each expert's bf16 row as FC2 stores it: partial_sums='fp8' is for "
     "combine='owner_sums'"),
])
def test_prepare_ep_weights_refuses_before_the_device(tmp_path, changes, error, message):
    arguments = dict(w13=W13, w2=W2, num_experts=8, top_k=2, rank=1, world_size=2, rendezvous_dir=str(tmp_path))
    arguments.update(changes)
    with pytest.raises(error, match=message):
        megamoe.prepare_ep_weights(**arguments)


def test_a_call_refused_on_this_rank_alone_keeps_the_layer_numbers_in_step(monkeypatch, tmp_path):
    """The ranks meet in a folder numbered by their prepare_ep_weights calls. A NaN in this rank's
    experts refuses the call here while the peers go on to create layer 0; the next layer must be
    layer 1 here too (it was 0, a folder the peers never look in)."""
    class Stop(Exception):
        pass

    folders = []

    def create_ep_layer(*arguments):
        folders.append(os.path.basename(arguments[12]))  # the layer's rendezvous folder
        raise Stop

    monkeypatch.setattr(expert_parallel, "_layers_made", 0)
    monkeypatch.setattr(expert_parallel, "ops", types.SimpleNamespace(
        check_layer=torch.ops.megamoe.check_layer, check_device=lambda index: 0, create_ep_layer=create_ep_layer))
    arguments = dict(num_experts=8, top_k=2, rank=1, world_size=2, rendezvous_dir=str(tmp_path))
    poisoned = W2.clone()
    poisoned[3, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"w2\[3, 0, 0\] = nan: weights must be finite"):
        megamoe.prepare_ep_weights(W13, poisoned, **arguments)
    with pytest.raises(Stop):
        megamoe.prepare_ep_weights(W13, W2, **arguments)
    assert folders == ["megamoe-ep-layer-1"]


def test_the_launchers_variables_must_be_integers(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"the environment variable RANK='zero' must be an integer"):
        megamoe.prepare_ep_weights(W13, W2, num_experts=8, top_k=2, rendezvous_dir=str(tmp_path))
    assert expert_parallel._folder_name(tmp_path, "rendezvous_dir") == str(tmp_path)
