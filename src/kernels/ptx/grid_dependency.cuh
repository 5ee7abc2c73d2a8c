// Programmatic dependent launch (PTX "griddepcontrol"): a kernel launched with programmatic
// stream serialization may start while the kernel before it on the stream is still running, so
// its launch latency and prologue overlap that kernel's tail.
#pragma once

namespace megamoe::ptx {

// Blocks until every prerequisite grid has completed and its memory operations are visible.
// Every thread that reads or writes memory an earlier kernel touches calls this first.
__device__ __forceinline__ void wait_for_prerequisite_grids() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the next kernel on the stream launch once every CTA of this grid has called this (or
// exited); the next kernel still waits for this grid's completion before it touches memory.
__device__ __forceinline__ void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;" :::); }

}  // namespace megamoe::ptx
