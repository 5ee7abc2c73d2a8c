#!/usr/bin/env python3
"""Each kernel's SASS bytes in a cubin, or how two cubins' kernels differ: the check that a change
leaves the kernels it does not mean to touch as they were.

With the L2 scrubbed (the benchmark method) a forward fetches the code it runs once from HBM as
it runs, so a decode-sized path pays for its SASS size (docs/decisions.md#h200-facts): a change to
a shared header can grow kernels it never meant to change, and no test sees it. Needs only
readelf (binutils), not CUDA's cuobjdump, so it runs on a machine without a GPU. Make the cubins
of one translation unit with the build's flags, e.g.

    nvcc -Iinclude -Isrc -isystem .deps/cutlass/include -O3 -DNDEBUG -std=c++17 \\
         -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -x cu -cubin \\
         src/kernels/impls/sm90_moe_forward.cu -o main.cubin

once on main and once with the change, then

    scripts/sass_sizes.py main.cubin            # every kernel's bytes
    scripts/sass_sizes.py main.cubin change.cubin   # kernels that differ, with their growth

A kernel is a `.text.<mangled name>` section; its bytes compare to the letter, so "identical"
means the same machine code. Kernel names are shortened to the template arguments that tell
megamoe's instantiations apart.
"""

import argparse
import re
import subprocess
import sys

SECTION = re.compile(r"^\s*\[\s*\d+\]\s+\.text\.(\S+)\s+\S+\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)\s")


def kernel_sections(readelf_output):
    """{mangled kernel name: (file offset, size)} from `readelf -S -W` output."""
    sections = {}
    for line in readelf_output.splitlines():
        match = SECTION.match(line)
        if match:
            sections[match.group(1)] = (int(match.group(2), 16), int(match.group(3), 16))
    return sections


def kernels(path):
    """{mangled kernel name: its SASS bytes} of the cubin at `path`."""
    listing = subprocess.run(["readelf", "-S", "-W", path], check=True, capture_output=True, text=True).stdout
    data = open(path, "rb").read()
    return {name: data[offset:offset + size] for name, (offset, size) in kernel_sections(listing).items()}


def short_name(mangled):
    """The kernel's name and the integer, bool and enum values among its template arguments, in
    order, e.g. `sm90_grouped_gemm_swapab_kernel<2,32,2,0,0>` (GroupedGemmConfig's precision,
    token tile, GEMM, and its flags); other names as they are, cut at 100 characters."""
    name = re.match(r"_ZN\d+megamoe\d+kernels(\d+)", mangled)
    if not name:
        return mangled[:100]
    length = int(name.group(1))
    base = mangled[name.end():name.end() + length]
    rest = mangled[name.end() + length:]
    config = rest[:rest.find("EE") + 1] if "EE" in rest else rest
    values = []
    i = 0
    while True:
        i = config.find("L", i)
        if i < 0:
            break
        literal = re.match(r"L(?:[ib]|NS0?_(\d+))", config[i:])
        if not literal:
            i += 1
            continue
        j = i + literal.end()
        if literal.group(1):  # an enum: its length-prefixed name, then E
            j += int(literal.group(1)) + 1
        value = re.match(r"-?\d+E", config[j:])
        if value:
            values.append(value.group(0)[:-1])
            j += value.end()
        i = j
    return f"{base}<{','.join(values)}>" if values else base


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cubin", help="a cubin (nvcc -cubin)")
    parser.add_argument("changed", nargs="?", help="a second cubin: list the kernels that differ")
    args = parser.parse_args(argv)
    before = kernels(args.cubin)
    if args.changed is None:
        for name, code in sorted(before.items(), key=lambda item: -len(item[1])):
            print(f"{len(code):8d}  {short_name(name)}")
        print(f"{sum(len(c) for c in before.values()):8d}  in all ({len(before)} kernels)")
        return 0
    after = kernels(args.changed)
    identical = 0
    for name in sorted(set(before) | set(after), key=short_name):
        if name not in after:
            print(f"{len(before[name]):8d} -> gone      {short_name(name)}")
        elif name not in before:
            print(f"     new -> {len(after[name]):8d}  {short_name(name)}")
        elif before[name] == after[name]:
            identical += 1
        else:
            a, b = len(before[name]), len(after[name])
            print(f"{a:8d} -> {b:8d}  {b - a:+7d} ({100.0 * (b - a) / a:+.1f}%)  {short_name(name)}")
    total_before = sum(len(c) for c in before.values())
    total_after = sum(len(c) for c in after.values())
    print(f"{identical} of {len(set(before) & set(after))} common kernels identical; "
          f"{total_before} -> {total_after} bytes in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
