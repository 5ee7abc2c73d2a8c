// NVSHMEM's symmetric heap as the storage of comm::SymmetricMemory (SymmetricBackend::nvshmem):
// the path to expert parallelism across nodes (docs/design.md#nvshmem-symmetric-memory).
//
// What megamoe takes from NVSHMEM is its host library only: the bootstrap (a unique id that rank 0
// draws and the FileRendezvous carries to the others), the collective heap allocation and
// nvshmem_ptr, which gives a load/store pointer to a peer's copy where one exists. The kernels
// stay the same: they read and write peers through plain pointers, as with CUDA IPC.
//
// NVSHMEM is one job per process (it cannot be initialized twice, nor again after a failed
// attempt), so the first allocation joins this process to a job of its rendezvous' ranks and the
// job lasts until the process ends; a later allocation, through any rendezvous (each layer of the
// Python face has its own folder), must be shared by the processes of that job, as the PEs their
// ranks number: the ranks compare their jobs first and all refuse together otherwise. Each
// collective below is entered only after a rendezvous exchange with a timeout has seen every rank
// arrive, so a rank that never comes ends in megamoe::Error(timeout) instead of a hang inside
// NVSHMEM.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "comm/rendezvous.hpp"

namespace megamoe::comm::nvshmem_heap {

// Whether this build links NVSHMEM (CMake MEGAMOE_NVSHMEM); without it every call below throws
// megamoe::Error(unsupported) saying how to build it.
bool built();
// Throws that error when !built().
void require_built();

// Collective over the rendezvous' ranks, on the caller's current device: allocates `bytes` on the
// symmetric heap, zero-filled, joining the NVSHMEM job first if no rank's process has one yet.
// `name` keys the rendezvous entries (unique per allocation, as for SymmetricMemory). Throws on
// every rank alike when the ranks are not one job, or when any rank's allocation fails.
void* allocate(const FileRendezvous& rendezvous, const std::string& name, size_t bytes,
               std::chrono::milliseconds timeout);

// The load/store pointer to rank `peer`'s copy of `local`, or null where NVSHMEM reaches that
// peer only through a network transport (another node). Thread-safe, as are the others.
void* peer_pointer(void* local, int peer);

// Frees `local`. NVSHMEM's free is collective: `every_rank_frees` says that every rank is known
// to be freeing its copy now (SymmetricMemory's closing barrier passed); without it nothing is
// freed, since the free would wait for a peer that is lost, and the heap goes with the process.
void release(void* local, bool every_rank_frees);

}  // namespace megamoe::comm::nvshmem_heap
