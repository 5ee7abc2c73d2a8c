"""megamoe.ep_bench's parts that need no GPU: its options and their refusals (exit 2, with the
message, before any rank or GPU work), the refusals of a launch it cannot run, the folder the
ranks leave their figures in, the table and the JSON records."""

import json
import re
from pathlib import Path

import pytest
import torch

from megamoe import ep_bench
from megamoe.workloads import WORKLOADS

CTEST_FILE = Path(__file__).resolve().parents[1] / "CMakeLists.txt"


def refusal(capsys, argv):
    """The message parse_options exits 2 with for `argv`."""
    with pytest.raises(SystemExit) as exit_info:
        ep_bench.parse_options(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_defaults():
    options = ep_bench.parse_options([])
    assert options == ep_bench.Options(workload="dsv3", tokens=[8, 128, 512, 4096], precision="fp8_block",
                                       launches=["staged", "fused"], replays=20, json_path=None)


def test_options_as_given(tmp_path):
    options = ep_bench.parse_options(["--workload", "qwen35-a3b", "--tokens", "1,64", "--precision", "bf16",
                                      "--launch", "fused", "--replays", "5", "--json", str(tmp_path / "a/b.json")])
    assert options.workload == "qwen35-a3b" and options.tokens == [1, 64] and options.precision == "bf16"
    assert options.launches == ["fused"] and options.replays == 5 and options.json_path == tmp_path / "a/b.json"
    # The path was shown writable without being left behind: rank 0 writes it at the end.
    assert (tmp_path / "a").is_dir() and list((tmp_path / "a").iterdir()) == []
    assert ep_bench.parse_options(["--launch", "fused,staged"]).launches == ["staged", "fused"]


@pytest.mark.parametrize("tokens", ["x", "0", "-3", "", "8,,128", "1.5"])
def test_bad_tokens_are_refused(capsys, tokens):
    message = refusal(capsys, ["--tokens", tokens])
    assert f"--tokens takes comma-separated positive integers (tokens per rank), got {tokens!r}" in message


def test_unknown_workload_is_refused(capsys):
    message = refusal(capsys, ["--workload", "nope"])
    assert "--workload: unknown workload 'nope'; known: " + ", ".join(WORKLOADS) in message


def test_a_shape_that_lacks_a_key_is_refused(capsys):
    message = refusal(capsys, ["--workload", "experts=8,top_k=2,hidden=4096"])
    assert "--workload: workload 'experts=8,top_k=2,hidden=4096': no intermediate" in message


@pytest.mark.parametrize("precision", ["fp8_tensor", "fp16"])
def test_precisions_the_bench_lacks_are_refused(capsys, precision):
    assert "this bench times bf16 or fp8_block layers" in refusal(capsys, ["--precision", precision])


@pytest.mark.parametrize("launch", ["single_kernel", "staged,nope", "", "staged,staged"])
def test_bad_launches_are_refused(capsys, launch):
    message = refusal(capsys, ["--launch", launch])
    assert f"--launch takes staged, fused or both, comma-separated, each once; got {launch!r}" in message


@pytest.mark.parametrize("replays", ["0", "-1"])
def test_replays_below_one_are_refused(capsys, replays):
    assert f"--replays must be at least 1, got {replays}" in refusal(capsys, ["--replays", replays])


def test_unwritable_json_paths_are_refused(capsys, tmp_path):
    # A file in the way of the parent folder stops even root, unlike a folder's permissions.
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for path in (blocker / "out.json", tmp_path, ""):
        message = refusal(capsys, ["--json", str(path)])
        assert f"--json needs a file it can write, got {str(path)!r}: " in message


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ep_bench.parse_options(["--help"])
    assert exit_info.value.code == 0
    assert "megamoe-run -n 2 [--one-gpu] -- python -m megamoe.ep_bench" in capsys.readouterr().out


def run_main(monkeypatch, capsys, environment, argv=()):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGAMOE_RENDEZVOUS_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    code = ep_bench.main(list(argv))
    return code, capsys.readouterr().err


def test_a_run_outside_megamoe_run_is_refused(monkeypatch, capsys):
    code, message = run_main(monkeypatch, capsys, {})
    assert code == 2
    assert "RANK, WORLD_SIZE, MEGAMOE_RENDEZVOUS_DIR not set: run one process per rank under megamoe-run" in message


@pytest.mark.parametrize("workload, ranks, why", [
    ("dsv3", "3", "dsv3's 256 experts do not split evenly over 3 ranks"),
    ("qwen3-30b-a3b", "32", "qwen3-30b-a3b routes each token to 8 experts, more than the 4 a rank holds over 32"),
])
def test_ranks_that_cannot_share_the_experts_are_refused(monkeypatch, capsys, tmp_path, workload, ranks, why):
    code, message = run_main(monkeypatch, capsys,
                             {"RANK": "0", "WORLD_SIZE": ranks, "MEGAMOE_RENDEZVOUS_DIR": str(tmp_path)},
                             ["--workload", workload])
    assert code == 2 and why in message


def test_rank_folder_gives_every_ranks_value_in_rank_order(tmp_path):
    folders = [ep_bench.RankFolder(str(tmp_path), rank, 3) for rank in range(3)]
    for rank in (2, 0, 1):
        folders[rank].publish("medians-1", {"staged": 10.0 + rank})
    assert folders[0].gather("medians-1") == [{"staged": 10.0}, {"staged": 11.0}, {"staged": 12.0}]
    assert not list(folders[0].folder.glob("*.writing"))


def test_rank_folder_names_the_ranks_that_never_published(tmp_path):
    folders = [ep_bench.RankFolder(str(tmp_path), rank, 4, timeout_s=0.05) for rank in range(4)]
    folders[0].publish("gpu", {})
    folders[2].publish("gpu", {})
    with pytest.raises(ep_bench.BenchFailure, match=r"rank 0 waited 0 s for rank\(s\) 1, 3 to publish 'gpu'"):
        folders[0].gather("gpu")


def test_ranks_sharing_a_gpu_are_seen_by_uuid_or_pci_address():
    a, b = dict(uuid="GPU-a", pci="0000:18:00"), dict(uuid="GPU-b", pci="0000:2a:00")
    assert not ep_bench.ranks_share_one_gpu([a, b])
    assert ep_bench.ranks_share_one_gpu([a, b, dict(a)])
    assert ep_bench.ranks_share_one_gpu([a, dict(uuid="GPU-c", pci=a["pci"])])
    assert not ep_bench.ranks_share_one_gpu([a])


def test_routed_inputs_draw_distinct_experts_and_positive_weights():
    workload = WORKLOADS["qwen35-a3b"]
    x, ids, weights = ep_bench.routed_inputs(workload, 50, torch.Generator().manual_seed(1))
    assert x.shape == (50, workload.hidden) and x.dtype == torch.bfloat16
    assert ids.shape == (50, workload.top_k) and ids.dtype == torch.int32
    assert ids.min() >= 0 and ids.max() < workload.experts
    assert all(len(set(row)) == workload.top_k for row in ids.tolist())
    assert weights.dtype == torch.float32 and (weights > 0).all()
    assert torch.allclose(weights.sum(dim=1), torch.ones(50))


def ctest_pass_expression() -> str:
    """python.ep_bench_one_gpu's PASS_REGULAR_EXPRESSION, as CMake hands it to CTest."""
    text = CTEST_FILE.read_text()
    entry = text[text.index("set_tests_properties(python.ep_bench_one_gpu"):]
    quoted = re.search(r'PASS_REGULAR_EXPRESSION "((?:[^"\\]|\\.)*)"', entry).group(1)
    return quoted.replace("\\\\", "\\")


def test_ctest_passes_on_the_last_row_the_bench_prints():
    expression = re.compile(ctest_pass_expression())
    row = ep_bench.table_row(64, {"staged": 812.25, "fused": 790.5})
    assert row.split(" | ")[-1].strip() == "0.97"
    assert expression.search(f"[rank 0] {row}")
    assert not expression.search(f"[rank 0] {ep_bench.table_row(1, {'staged': 64.0, 'fused': 64.0})}")
    assert not expression.search(f"[rank 1] {row}")


def test_table_columns_name_their_units():
    assert ep_bench.table_columns(["staged", "fused"]).split(" | ") == [
        "tokens/rank", " staged µs", "  fused µs", "fused/staged"]
    assert ep_bench.table_columns(["fused"]).split(" | ") == ["tokens/rank", "  fused µs"]
    assert ep_bench.table_row(8, {"fused": 12.34}).split(" | ") == ["          8", "      12.3"]


def test_records_give_the_slowest_rank_and_each_rank():
    options = ep_bench.parse_options(["--workload", "qwen35-a3b", "--replays", "7"])
    origin = ep_bench.provenance(["--workload", "qwen35-a3b", "--replays", "7"])
    records = ep_bench.records_of(options, 64, [{"staged": 10.0, "fused": 9.0}, {"staged": 12.0, "fused": 8.5}],
                                  True, "NVIDIA H100 80GB HBM3", origin)
    assert [r["launch"] for r in records] == ["staged", "fused"]
    assert [r["forward_us"] for r in records] == [12.0, 9.0]
    assert [r["per_rank_us"] for r in records] == [[10.0, 12.0], [9.0, 8.5]]
    for record in records:
        assert set(record) == {"workload", "precision", "ranks", "tokens_per_rank", "launch", "forward_us",
                               "per_rank_us", "method", "ranks_share_one_gpu", "gpu", "torch", "date", "command",
                               "megamoe_version"}
        assert record["ranks"] == 2 and record["tokens_per_rank"] == 64 and record["ranks_share_one_gpu"] is True
        assert "7 replays back to back" in record["method"] and "keep the ranks in step" in record["method"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["date"])
        assert record["command"].endswith("-m megamoe.ep_bench --workload qwen35-a3b --replays 7")
    json.dumps(records)


def test_header_says_when_ranks_share_one_gpu():
    options = ep_bench.parse_options([])
    shared = ep_bench.header_line(options, 2, "NVIDIA H100 80GB HBM3", True)
    assert "dsv3 fp8_block on 2 ranks, NVIDIA H100 80GB HBM3" in shared and "time-sliced ranks, not NVLink" in shared
    assert "not NVLink" not in ep_bench.header_line(options, 2, "NVIDIA H100 80GB HBM3", False)
