#!/usr/bin/env python3
"""scripts/sass_sizes.py on ELF objects the host compiler makes with one `.text.<name>` section per
function, as a cubin holds one per kernel: each section's bytes are read from the file (not only
its size), two objects whose sections differ in code but not in size are told apart, and
megamoe's mangled config names shorten to their template values. Needs cc and readelf; plain
asserts, exits non-zero on the first failure."""
import importlib.util
import pathlib
import subprocess
import tempfile

TOOL = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "sass_sizes.py"
spec = importlib.util.spec_from_file_location("sass_sizes", TOOL)
sass_sizes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_sizes)


def build(folder, name, second_body):
    """An object with functions `same` (alike in every build) and `other` (its body given)."""
    source = folder / f"{name}.c"
    source.write_text(
        "int same(int x) { return x * 3 + 1; }\n"
        f"int other(int x) {{ {second_body} }}\n")
    obj = folder / f"{name}.o"
    subprocess.run(["cc", "-O1", "-ffunction-sections", "-c", str(source), "-o", str(obj)], check=True)
    return str(obj)


with tempfile.TemporaryDirectory() as scratch:
    folder = pathlib.Path(scratch)
    add = build(folder, "add", "return x + 7;")
    sub = build(folder, "sub", "return x - 7;")
    longer = build(folder, "longer", "return (x * x + 5) / (x | 1) + (x >> 3) * 11;")
    a, b, c = sass_sizes.kernels(add), sass_sizes.kernels(sub), sass_sizes.kernels(longer)
    assert set(a) == {"same", "other"}, a.keys()
    assert a["same"] == b["same"] == c["same"], "the same function, the same bytes"
    assert len(a["other"]) == len(b["other"]) and a["other"] != b["other"], "same size, other code"
    assert len(c["other"]) > len(a["other"]), "a longer body, more bytes"

# A swapAB GEMM instantiation's name keeps its precision, token tile, GEMM and flags.
MANGLED = ("_ZN7megamoe7kernels31sm90_grouped_gemm_swapab_kernelINS0_17GroupedGemmConfigILNS_9PrecisionE2ELi32EL"
           "NS0_6GemmOpE0ELb0ELb1EEENS0_17GroupedGemmParamsIN4cute5TmaDescEEEEEvT0_")
assert sass_sizes.short_name(MANGLED) == "sm90_grouped_gemm_swapab_kernel<2,32,0,0,1>", sass_sizes.short_name(MANGLED)
assert sass_sizes.short_name("_ZN7megamoe7kernels22route_and_count_kernelENS0_13RoutingParamsE") == "route_and_count_kernel"
assert sass_sizes.short_name("_Z5firstv") == "_Z5firstv"
print("sass_sizes: ok")
