#!/usr/bin/env python3
"""scripts/sass_by_source.py on a made-up disassembly shaped as nvdisasm --print-line-info-inline
writes it: each instruction counts for the innermost file of the comment group above it that is
the repository's own code (not our ptx/ headers, CUDA's headers wherever installed, or .deps/),
a group whose first line is only wrappers takes its next line's caller, and kernels are kept
apart. Plain asserts; exits non-zero on the first failure."""
import importlib.util
import pathlib

TOOL = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "sass_by_source.py"
spec = importlib.util.spec_from_file_location("sass_by_source", TOOL)
sass_by_source = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_by_source)

REPO = "/home/u/megamoe"
ROOT = REPO + "/src/kernels"
DISASSEMBLY = f"""
	.section	.text._Z5firstv,"ax",@progbits
.text._Z5firstv:
	//## File "{ROOT}/routing/route_token.cuh", line 10 inlined at "{ROOT}/impls/k.cuh", line 3
	//## File "{ROOT}/impls/k.cuh", line 3
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD R2, R1, R1, RZ ;
	//## File "{ROOT}/ptx/memory.cuh", line 5 inlined at "/usr/local/cuda/include/sm_30_intrinsics.hpp", line 1
	//## File "{ROOT}/combine/bf16x8.cuh", line 40 inlined at "{ROOT}/impls/k.cuh", line 9
        /*0020*/                   LDG.E.128 R4, [R2.64] ;
	//## File "{REPO}/.deps/cutlass/include/cute/arch/mma.hpp", line 7 inlined at "{ROOT}/mma/swapab_mainloop.cuh", line 80
        /*0030*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24 ;
	//## File "/opt/conda/lib/python3/site-packages/nvidia/cu13/include/sm_30_intrinsics.hpp", line 3 inlined at "{REPO}/tools/code_fetch_probe.cu", line 9
        /*0040*/                   SHFL.BFLY PT, R5, R4, 0x1, 0x1f ;
	.section	.text._Z6secondv,"ax",@progbits
.text._Z6secondv:
        /*0000*/                   EXIT ;
"""

counts = sass_by_source.count(DISASSEMBLY, REPO)
assert set(counts) == {"_Z5firstv", "_Z6secondv"}, counts
first = counts["_Z5firstv"]
assert first["routing/route_token.cuh"] == 2, first
assert first["combine/bf16x8.cuh"] == 1, first
assert first["mma/swapab_mainloop.cuh"] == 1, first
assert first["tools/code_fetch_probe.cu"] == 1, first
assert sum(first.values()) == 5, first
assert counts["_Z6secondv"] == {"(no line info)": 1}, counts["_Z6secondv"]
print("sass_by_source.py: instructions counted for the innermost file that is not a wrapper")
