#!/usr/bin/env python3
"""Instructions of each kernel by the source file they come from, from a build with -lineinfo.

With the L2 scrubbed (the benchmark method) a forward fetches the code it runs once (the front
role, the epilogues, the combine) from HBM as it runs, so a one-shot path's SASS size costs time
of its own (docs/decisions.md#h200-facts). This counts, per kernel, the instructions whose
innermost source line lies in each file under src/kernels/ (our ptx/ wrappers, CUDA's headers and
CUTLASS are skipped, so a wrapper's instructions count for its caller).

    scripts/sass_by_source.py build-gpu/libmegamoe_kernels.a --kernel route_and_count
    scripts/sass_by_source.py some.cubin --kernel sm90_moe_single_kernel --top 12

Needs cuobjdump and nvdisasm (CUDA's bin folder, or the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels) on PATH; an object or archive is unpacked with cuobjdump -xelf.
"""

import argparse
import collections
import pathlib
import re
import subprocess
import sys
import tempfile

SECTION = re.compile(r"^\.text\.(\S+):")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S")
LOCATION = re.compile(r'"([^"]+)", line \d+')


WRAPPERS = ("/kernels/ptx/", "/.deps/", "/cutlass/", "/cute/", "/cuda/", "/usr/")


def owner(line):
    """The innermost file of a line-info comment that is not a wrapper (our PTX wrappers, CUDA's
    intrinsics headers, CUTLASS)."""
    for path in LOCATION.findall(line):
        if any(part in path for part in WRAPPERS):
            continue
        marker = "/src/kernels/"
        return path.split(marker, 1)[1] if marker in path else path
    return "(wrappers only)"


def count(disassembly):
    """{kernel: Counter(file -> instructions)} from nvdisasm --print-line-info-inline output."""
    kernels = {}
    counts = None
    current = "(no line info)"
    in_group = False
    for line in disassembly.splitlines():
        section = SECTION.match(line)
        if section:
            counts = kernels.setdefault(section.group(1), collections.Counter())
            current, in_group = "(no line info)", False
            continue
        if counts is None:
            continue
        stripped = line.strip()
        if stripped.startswith("//## File"):
            # A group of comments precedes an instruction: its first line is the innermost call;
            # a wrapper-only first line takes the next line's caller.
            if not in_group or current == "(wrappers only)":
                current = owner(stripped)
            in_group = True
            continue
        if INSTRUCTION.match(line):
            in_group = False
            counts[current] += 1
    return kernels


def disassemble(path, scratch):
    if path.suffix == ".cubin":
        cubins = [path]
    else:
        subprocess.run(["cuobjdump", "-xelf", "all", str(path.resolve())], cwd=scratch, check=True,
                       stdout=subprocess.DEVNULL)
        cubins = sorted(pathlib.Path(scratch).glob("*.cubin"))
    for cubin in cubins:
        yield subprocess.run(["nvdisasm", "--print-line-info-inline", "-c", str(cubin)], check=True,
                             capture_output=True, text=True).stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary", type=pathlib.Path, help="a .cubin, an object or a static library")
    parser.add_argument("--kernel", default="", help="only kernels whose mangled name contains this")
    parser.add_argument("--top", type=int, default=20, help="files listed per kernel")
    args = parser.parse_args()
    if not args.binary.exists():
        sys.exit(f"sass_by_source: no such file: {args.binary}")
    found = 0
    with tempfile.TemporaryDirectory() as scratch:
        try:
            for text in disassemble(args.binary, scratch):
                for kernel, counts in count(text).items():
                    if args.kernel not in kernel:
                        continue
                    found += 1
                    print(f"{kernel}: {sum(counts.values())} instructions")
                    for path, n in counts.most_common(args.top):
                        print(f"  {n:7d}  {path}")
        except FileNotFoundError as missing:
            sys.exit(f"sass_by_source: {missing.filename} is not on PATH (CUDA's bin folder has it)")
        except subprocess.CalledProcessError as failed:
            sys.exit(f"sass_by_source: {' '.join(failed.cmd[:2])} failed on {args.binary} (exit {failed.returncode}): "
                     "not a CUDA object, archive or cubin?")
    if found == 0:
        sys.exit(f"sass_by_source: no kernel matching '{args.kernel}' in {args.binary}")


if __name__ == "__main__":
    main()
