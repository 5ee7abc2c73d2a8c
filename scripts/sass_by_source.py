#!/usr/bin/env python3
"""Instructions of each kernel by the source file they come from, from a build with -lineinfo.

With the L2 scrubbed (the benchmark method) a forward fetches the code it runs once (the front
role, the epilogues, the combine) from HBM as it runs, so a one-shot path's SASS size costs time
of its own (docs/decisions.md#h200-facts). This counts, per kernel, the instructions whose
innermost source line lies in each file of the repository (src/kernels/ files by their path below
it; our ptx/ wrappers, CUDA's headers and CUTLASS are skipped, so a wrapper's instructions count
for its caller). A kernel's non-inlined device functions, if any, are sections of their own and
not in its total.

    scripts/sass_by_source.py build-gpu/libmegamoe_kernels.a --kernel route_and_count
    scripts/sass_by_source.py some.cubin --kernel sm90_moe_single_kernel --kernel combine_kernel --top 12

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


def owner(line, root):
    """The innermost file of a line-info comment that is this repository's own code (under `root`,
    not in .deps/ or src/kernels/ptx/); everything else (our PTX wrappers, CUDA's headers wherever
    they are installed, CUTLASS) is a wrapper that counts for its caller."""
    for path in LOCATION.findall(line):
        if not path.startswith(root + "/"):
            continue
        relative = path[len(root) + 1:]
        if relative.startswith(".deps/") or relative.startswith("src/kernels/ptx/"):
            continue
        return relative[len("src/kernels/"):] if relative.startswith("src/kernels/") else relative
    return "(no repository frame)"


def count(disassembly, root):
    """{kernel: Counter(file -> instructions)} from nvdisasm --print-line-info-inline output of a
    build of the repository at `root`."""
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
            if not in_group or current == "(no repository frame)":
                current = owner(stripped, root)
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
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        cubins = sorted(pathlib.Path(scratch).glob("*.cubin"))
    for cubin in cubins:
        yield subprocess.run(["nvdisasm", "--print-line-info-inline", "-c", str(cubin)], check=True,
                             capture_output=True, text=True).stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary", type=pathlib.Path, help="a .cubin, an object or a static library")
    parser.add_argument("--kernel", action="append", default=[],
                        help="only kernels whose mangled name contains this (repeatable: any of them)")
    parser.add_argument("--top", type=int, default=20, help="files listed per kernel")
    parser.add_argument("--root", default=str(pathlib.Path(__file__).resolve().parents[1]),
                        help="the repository the binary was built from, as its line info names it "
                             "(default: this script's)")
    args = parser.parse_args()
    if not args.binary.exists():
        sys.exit(f"sass_by_source: no such file: {args.binary}")
    found = 0
    with tempfile.TemporaryDirectory() as scratch:
        try:
            for text in disassemble(args.binary, scratch):
                for kernel, counts in count(text, args.root.rstrip("/")).items():
                    if args.kernel and not any(part in kernel for part in args.kernel):
                        continue
                    found += 1
                    print(f"{kernel}: {sum(counts.values())} instructions")
                    for path, n in counts.most_common(args.top):
                        print(f"  {n:7d}  {path}")
        except FileNotFoundError as missing:
            sys.exit(f"sass_by_source: {missing.filename} is not on PATH (CUDA's bin folder has it)")
        except subprocess.CalledProcessError as failed:
            detail = (failed.stderr or "").strip()
            sys.exit(f"sass_by_source: {' '.join(failed.cmd[:2])} failed on {args.binary} (exit {failed.returncode}): "
                     f"not a CUDA object, archive or cubin? {detail}")
    if found == 0:
        sys.exit(f"sass_by_source: no kernel matching {' or '.join(args.kernel) or 'anything'} in {args.binary}")


if __name__ == "__main__":
    main()
