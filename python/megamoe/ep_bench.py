"""python -m megamoe.ep_bench: the expert-parallel layer (prepare_ep_weights, ep_fused_moe) timed
from PyTorch, one process per rank:

    megamoe-run -n 2 [--one-gpu] -- python -m megamoe.ep_bench [--workload dsv3] [--tokens 8,128,512,4096]
                                  [--precision fp8_block|bf16] [--launch staged,fused] [--replays 20] [--json PATH]

Rank r holds experts [r * E / R, (r + 1) * E / R) of random weights drawn on its GPU. Per token
count per rank, each rank routes its own random tokens to experts drawn uniformly over all E, the
fused layer's y is checked against the staged layer's bit for bit, and each launch is timed as a
user of ep_fused_moe would run it: a CUDA graph of 10 back-to-back forwards, captured alike on every
rank, replayed 3 times to warm up, then --replays times, each replay between two CUDA events; a
forward's time is a replay's over 10, and a rank's figure the median over replays. Every forward
waits for its peers on the device, so back-to-back replays keep the ranks in step: no host or
device barrier sits between them (megamoe-ep-bench instead times each eager forward after a
cross-rank device barrier). The figure printed is the slowest rank's. Ranks that share one GPU
(megamoe-run --one-gpu) time-slice it: their figures are not NVLink's, and the header line and the
JSON say so.
"""

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

import megamoe
from megamoe.bench import random_weights
from megamoe.workloads import SHAPE_FORM, WORKLOADS, Workload, find_workload

DEFAULT_TOKENS = (8, 128, 512, 4096)
LAUNCHES = ("staged", "fused")
EP_PRECISIONS = ("bf16", "fp8_block")
CALLS_PER_GRAPH = 10
WARMUP_REPLAYS = 3
# Long enough for a peer still drawing and packing dsv3's weights, or still timing on a shared GPU.
PEER_TIMEOUT_S = 120.0
USAGE_EXIT_CODE = 2


def method(replays: int) -> str:
    """How a record's figures were measured, as the JSON says it."""
    return (f"ep_fused_moe in a CUDA graph of {CALLS_PER_GRAPH} back-to-back forwards, captured alike on every rank; "
            f"{WARMUP_REPLAYS} warm-up replays, then {replays} replays back to back, each between two CUDA events; "
            f"per forward: a replay's time / {CALLS_PER_GRAPH}, the median over replays; every forward waits for "
            f"its peers on the device, so back-to-back replays keep the ranks in step (no host or device barrier "
            f"between them); L2 not evicted; forward_us is the slowest rank's median")


# ------------------------------------------------------------------ options

@dataclasses.dataclass(frozen=True)
class Options:
    workload: str
    tokens: List[int]
    precision: str
    launches: List[str]
    replays: int
    json_path: Optional[Path]


def token_counts(text: str) -> List[int]:
    """Comma-separated positive integers; ValueError for anything else."""
    counts = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise ValueError
        counts.append(int(part))
    return counts


def checked_writable(path_text: str) -> Path:
    """The --json path, once this process showed it can write there (creating the parent folders).
    A file that is not there yet is tried through a probe of its own beside it, so that ranks
    checking the same path at once neither race for it nor leave it behind."""
    if not path_text:
        raise OSError("an empty path")
    path = Path(path_text)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with open(path, "a"):
            pass
    else:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    return path


def parse_options(argv: Optional[List[str]] = None) -> Options:
    """The options, checked; a usage error exits 2 with its message, before any rank or GPU work."""
    parser = argparse.ArgumentParser(prog="python -m megamoe.ep_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="dsv3",
                        help=f"{', '.join(WORKLOADS)} (default %(default)s), or a layer of your own shape, {SHAPE_FORM}")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                        help="tokens per rank, comma-separated positive integers (default %(default)s)")
    parser.add_argument("--precision", default="fp8_block", help="bf16 or fp8_block (default %(default)s)")
    parser.add_argument("--launch", default=",".join(LAUNCHES),
                        help="the layer launches to time, comma-separated: staged, fused (default %(default)s)")
    parser.add_argument("--replays", type=int, default=20, help="timed CUDA-graph replays (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="rank 0 writes one record per token count and launch there")
    args = parser.parse_args(argv)

    try:
        find_workload(args.workload)
    except ValueError as e:
        parser.error(f"--workload: {e}")
    try:
        tokens = token_counts(args.tokens)
    except ValueError:
        parser.error(f"--tokens takes comma-separated positive integers (tokens per rank), got {args.tokens!r}")
    if args.precision not in EP_PRECISIONS:
        parser.error(f"--precision {args.precision}: this bench times bf16 or fp8_block layers, staged against fused "
                     f"(an fp8_tensor layer runs staged only: megamoe-ep-bench --precision fp8_tensor times it)")
    launches = args.launch.split(",")
    unknown = [launch for launch in launches if launch not in LAUNCHES]
    if unknown or len(set(launches)) != len(launches):
        parser.error(f"--launch takes staged, fused or both, comma-separated, each once; got {args.launch!r}")
    if args.replays < 1:
        parser.error(f"--replays must be at least 1, got {args.replays}")
    json_path = None
    if args.json is not None:
        try:
            json_path = checked_writable(args.json)
        except OSError as e:
            parser.error(f"--json needs a file it can write, got {args.json!r}: {e.strerror or e}")
    return Options(workload=args.workload, tokens=tokens, precision=args.precision,
                   launches=[launch for launch in LAUNCHES if launch in launches], replays=args.replays,
                   json_path=json_path)


def provenance(argv: List[str]) -> Dict[str, str]:
    """Where a record comes from, under megamoe-ep-bench's keys: when the run started (UTC), its
    command line as run, the megamoe version."""
    return dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                command=shlex.join([sys.executable, "-m", "megamoe.ep_bench", *argv]),
                megamoe_version=megamoe.__version__)


# ------------------------------------------------------------------ the ranks

@dataclasses.dataclass(frozen=True)
class Launched:
    """What megamoe-run tells each rank."""

    rank: int
    world_size: int
    local_rank: int
    rendezvous_dir: str


class UsageError(Exception):
    pass


class BenchFailure(Exception):
    pass


def launched(environment=os.environ) -> Launched:
    """This rank's place, from megamoe-run's environment; UsageError naming what is missing."""
    names = ("RANK", "WORLD_SIZE", "MEGAMOE_RENDEZVOUS_DIR")
    missing = [name for name in names if not environment.get(name)]
    if missing:
        raise UsageError(f"{', '.join(missing)} not set: run one process per rank under megamoe-run, e.g. "
                         f"megamoe-run -n 2 -- {sys.executable} -m megamoe.ep_bench")
    try:
        rank, world_size = int(environment["RANK"]), int(environment["WORLD_SIZE"])
        local_rank = int(environment.get("LOCAL_RANK", rank))
    except ValueError:
        raise UsageError(f"RANK={environment['RANK']!r}, WORLD_SIZE={environment['WORLD_SIZE']!r} and LOCAL_RANK "
                         f"must be integers") from None
    if not 0 <= rank < world_size:
        raise UsageError(f"RANK={rank} is not in [0, WORLD_SIZE={world_size})")
    return Launched(rank, world_size, local_rank, environment["MEGAMOE_RENDEZVOUS_DIR"])


def check_split(workload: Workload, name: str, world_size: int) -> None:
    """UsageError where `world_size` ranks cannot share the workload's experts evenly, or a rank
    would hold fewer experts than a token's top_k (prepare_ep_weights' rule)."""
    if workload.experts % world_size:
        raise UsageError(f"{name}'s {workload.experts} experts do not split evenly over {world_size} ranks")
    if workload.top_k > workload.experts // world_size:
        raise UsageError(f"{name} routes each token to {workload.top_k} experts, more than the "
                         f"{workload.experts // world_size} a rank holds over {world_size} ranks")


class RankFolder:
    """Small JSON values the ranks leave for rank 0 in a folder of megamoe-run's rendezvous folder,
    one file per key and rank, each written aside and renamed so that it appears whole."""

    def __init__(self, rendezvous_dir: str, rank: int, world_size: int, timeout_s: float = PEER_TIMEOUT_S):
        self.folder = Path(rendezvous_dir) / "megamoe-ep-bench"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s

    def _path(self, key: str, rank: int) -> Path:
        return self.folder / f"{key}.rank{rank}.json"

    def publish(self, key: str, value) -> None:
        path = self._path(key, self.rank)
        aside = path.with_name(path.name + ".writing")
        aside.write_text(json.dumps(value))
        os.replace(aside, path)

    def gather(self, key: str) -> list:
        """Every rank's value under `key`, in rank order; BenchFailure naming the ranks that did
        not publish it within the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = [r for r in range(self.world_size) if not self._path(key, r).exists()]
            if not missing:
                return [json.loads(self._path(key, r).read_text()) for r in range(self.world_size)]
            if time.monotonic() > deadline:
                raise BenchFailure(f"rank {self.rank} waited {self.timeout_s:.0f} s for rank(s) "
                                   f"{', '.join(map(str, missing))} to publish {key!r} in {self.folder}")
            time.sleep(0.02)


def gpu_identity(device: torch.device) -> Dict[str, str]:
    properties = torch.cuda.get_device_properties(device)
    return dict(uuid=str(properties.uuid),
                pci=f"{properties.pci_domain_id:04x}:{properties.pci_bus_id:02x}:{properties.pci_device_id:02x}")


def ranks_share_one_gpu(identities: List[Dict[str, str]]) -> bool:
    """Whether two ranks run on one device (by UUID or PCI address)."""
    return any(len({identity[field] for identity in identities}) < len(identities) for field in ("uuid", "pci"))


# ------------------------------------------------------------------ measuring

def routed_inputs(workload: Workload, tokens: int, generator: torch.Generator):
    """(x [T, H] bf16, ids [T, k] int32, weights [T, k] float32): ids drawn uniformly without
    repetition over every expert, weights positive and summing to 1 per token. ids and weights in
    the kernels' dtypes, so that the graph holds the layer's launches alone."""
    device = generator.device
    x = torch.randn(tokens, workload.hidden, device=device, generator=generator).to(torch.bfloat16)
    ids = torch.rand(tokens, workload.experts, device=device, generator=generator).topk(workload.top_k, dim=1).indices
    weights = torch.rand(tokens, workload.top_k, device=device, generator=generator) + 0.01
    return x, ids.to(torch.int32), weights / weights.sum(dim=1, keepdim=True)


def median_forward_us(forward: Callable[[], object], replays: int) -> float:
    """The median µs a forward takes in back-to-back replays of a graph of CALLS_PER_GRAPH of them."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            forward()
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH for start, end in zip(starts, ends))


def checked_outputs(layers: Dict[str, megamoe.EpMoeWeights], x, ids, weights, rank: int, tokens: int) -> None:
    """BenchFailure where a launch's y is not finite, or the fused layer's is not the staged one's."""
    outputs = {launch: megamoe.ep_fused_moe(x, layer, ids, weights) for launch, layer in layers.items()}
    for launch, layer in layers.items():
        layer.check_peers()
        if not torch.isfinite(outputs[launch]).all():
            raise BenchFailure(f"rank {rank}, {tokens} tokens per rank: the {launch} layer's y is not finite")
    if len(outputs) == len(LAUNCHES) and not torch.equal(outputs["fused"], outputs["staged"]):
        raise BenchFailure(f"rank {rank}, {tokens} tokens per rank: the fused layer's y differs from the staged "
                           f"layer's")


# ------------------------------------------------------------------ reporting

def header_line(options: Options, world_size: int, gpu: str, shared_gpu: bool) -> str:
    where = ("ranks sharing one GPU: time-sliced ranks, not NVLink" if shared_gpu else "one GPU a rank")
    return (f"megamoe.ep_bench: {options.workload} {options.precision} on {world_size} ranks, {gpu} ({where}); "
            f"µs per forward, the slowest rank's median of CUDA-graph replays of {CALLS_PER_GRAPH} forwards")


def table_columns(launches: List[str]) -> str:
    columns = [f"{'tokens/rank':>11}", *(f"{launch + ' µs':>10}" for launch in launches)]
    if len(launches) == len(LAUNCHES):
        columns.append(f"{'fused/staged':>12}")
    return " | ".join(columns)


def table_row(tokens: int, slowest_us: Dict[str, float]) -> str:
    cells = [f"{tokens:>11}", *(f"{us:>10.1f}" for us in slowest_us.values())]
    if len(slowest_us) == len(LAUNCHES):
        cells.append(f"{slowest_us['fused'] / slowest_us['staged']:>12.2f}")
    return " | ".join(cells)


def records_of(options: Options, tokens: int, per_rank_us: List[Dict[str, float]], shared_gpu: bool, gpu: str,
               origin: Dict[str, str]) -> List[dict]:
    """One record per launch, the slowest rank's figure first, each rank's beside it."""
    return [dict(workload=options.workload, precision=options.precision, ranks=len(per_rank_us),
                 tokens_per_rank=tokens, launch=launch, forward_us=max(us[launch] for us in per_rank_us),
                 per_rank_us=[us[launch] for us in per_rank_us], method=method(options.replays),
                 ranks_share_one_gpu=shared_gpu, gpu=gpu, torch=torch.__version__, **origin)
            for launch in options.launches]


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the run

def run(options: Options, place: Launched, origin: Dict[str, str]) -> None:
    """This rank's part; rank 0 also prints and writes the slowest rank's figures. Every layer call
    is collective, so every rank makes them in the same order."""
    workload = find_workload(options.workload)
    rank, world_size = place.rank, place.world_size
    torch.cuda.set_device(place.local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    folder = RankFolder(place.rendezvous_dir, rank, world_size)
    folder.publish("gpu", gpu_identity(device))
    gpu = torch.cuda.get_device_name(device)
    shared_gpu = False
    if rank == 0:
        shared_gpu = ranks_share_one_gpu(folder.gather("gpu"))
        print(header_line(options, world_size, gpu, shared_gpu), flush=True)

    local_experts = workload.experts // world_size
    if rank == 0:
        progress(f"drawing {local_experts} experts a rank and preparing the {' and '.join(options.launches)} layers")
    generator = torch.Generator(device=device).manual_seed(rank)
    w13 = random_weights(local_experts, 2 * workload.intermediate, workload.hidden, generator)
    w2 = random_weights(local_experts, workload.hidden, workload.intermediate, generator)
    # Collective: prepared in the same order on every rank.
    layers = {launch: megamoe.prepare_ep_weights(w13, w2, num_experts=workload.experts, top_k=workload.top_k,
                                                 precision=options.precision, max_tokens=max(options.tokens),
                                                 rank=rank, world_size=world_size,
                                                 rendezvous_dir=place.rendezvous_dir, device=device, launch=launch)
              for launch in options.launches}
    del w13, w2  # only the packed copies are used from here; dsv3's bf16 share is ~10 GiB a rank on two
    torch.cuda.empty_cache()

    if rank == 0:
        print(table_columns(options.launches), flush=True)
    records = []
    for step, tokens in enumerate(options.tokens, start=1):
        if rank == 0:
            progress(f"[{step}/{len(options.tokens)}] {tokens} tokens per rank")
        x, ids, weights = routed_inputs(workload, tokens,
                                        torch.Generator(device=device).manual_seed(1000 * tokens + rank))
        checked_outputs(layers, x, ids, weights, rank, tokens)
        medians = {}
        for launch, layer in layers.items():
            medians[launch] = median_forward_us(lambda layer=layer: megamoe.ep_fused_moe(x, layer, ids, weights),
                                                options.replays)
            # A peer that fell behind past the barrier timeout would leave figures of timeouts.
            layer.check_peers()
        folder.publish(f"medians-{step}", medians)
        if rank == 0:
            per_rank_us = folder.gather(f"medians-{step}")
            slowest = {launch: max(us[launch] for us in per_rank_us) for launch in options.launches}
            print(table_row(tokens, slowest), flush=True)
            records += records_of(options, tokens, per_rank_us, shared_gpu, gpu, origin)

    # Collective: closed in the same order on every rank.
    for layer in layers.values():
        layer.close()
    if rank == 0 and options.json_path is not None:
        options.json_path.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {options.json_path}", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = parse_options(argv)
    origin = provenance(argv)
    try:
        place = launched()
        check_split(find_workload(options.workload), options.workload, place.world_size)
    except UsageError as e:
        print(f"python -m megamoe.ep_bench: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    visible = torch.cuda.device_count()
    if visible == 0 or torch.cuda.get_device_capability(place.local_rank % visible) != (9, 0):
        print(f"python -m megamoe.ep_bench: rank {place.rank} sees no Hopper GPU (sm_90)", file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        run(options, place, origin)
    except BenchFailure as e:
        print(f"python -m megamoe.ep_bench: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
