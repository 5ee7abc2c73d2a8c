// Symmetric memory: one buffer of the same size on every rank, each rank's kernels reading and
// writing every peer's copy through plain pointers over NVLink.
//
// Backends (SymmetricBackend): CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle, handles
// exchanged through the FileRendezvous), which needs nothing beyond the CUDA runtime; and
// NVSHMEM's symmetric heap (comm/nvshmem_heap.hpp), the path to expert parallelism across nodes.
// Either way the kernels get the same thing, a table of peer pointers; NVSHMEM's device API is not
// used (docs/design.md#nvshmem-symmetric-memory).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm/rendezvous.hpp"

namespace megamoe::comm {

enum class SymmetricBackend {
  cuda_ipc,  // one node: cudaMalloc + CUDA IPC handles
  nvshmem,   // NVSHMEM's symmetric heap, peers through nvshmem_ptr (builds with MEGAMOE_NVSHMEM)
};
const char* to_string(SymmetricBackend backend);

class SymmetricMemory {
 public:
  // Collective: every rank calls it with the same name, size and `layout` (what the caller carves
  // the buffer into, in words: two layouts of one size would write into each other's regions),
  // on its current device: one GPU per rank, or several ranks (processes) sharing one GPU, whose
  // buffers then map through CUDA IPC on that device (with NVSHMEM: its processes-per-GPU mode).
  // Zero-fills the buffer. Throws megamoe::Error when the ranks' layouts, sizes or backends differ,
  // when a peer is not reachable by load/store (another GPU without P2P; with NVSHMEM, a peer on
  // another node), when the backend is not built, or when a peer does not arrive within `timeout`.
  SymmetricMemory(const FileRendezvous& rendezvous, const std::string& name, size_t bytes,
                  std::chrono::milliseconds timeout, SymmetricBackend backend = SymmetricBackend::cuda_ipc,
                  const std::string& layout = "");
  // The longest `layout` the ranks compare.
  static constexpr size_t kMaxLayoutChars = 127;
  // Collective as well: waits until every rank has closed its mappings before freeing, unless the
  // peers were abandoned. An NVSHMEM copy is freed only where every rank frees its own (the free is
  // collective); otherwise it stays on the heap until the process ends.
  ~SymmetricMemory();
  // After a peer was lost (comm::EpLayer::check_peers): the destructor frees without waiting for
  // the peers, which may never come (it still enters their closing barrier).
  void abandon_peers() { peers_abandoned_ = true; }
  SymmetricMemory(const SymmetricMemory&) = delete;
  SymmetricMemory& operator=(const SymmetricMemory&) = delete;

  void* local() const { return peers_[rank_]; }
  void* peer(int rank) const { return peers_[rank]; }
  // Device array of every rank's base pointer (index = rank), for kernels.
  void* const* device_peer_table() const { return device_table_; }
  size_t bytes() const { return bytes_; }
  int rank() const { return rank_; }
  int world_size() const { return static_cast<int>(peers_.size()); }
  SymmetricBackend backend() const { return backend_; }

 private:
  struct PublishedCopy;
  // After this rank's copy exists (CUDA IPC) or may be allocated (NVSHMEM): exchanges the records,
  // refuses what they show (differing sizes or backends, any rank's `refusal`: an error's code and
  // message, empty where this rank does not refuse), then maps every peer's copy; every rank throws
  // together when one cannot.
  void map_peers(const PublishedCopy& mine, const std::vector<uint8_t>& refusal);
  void open_ipc_peers(const std::vector<PublishedCopy>& theirs);
  // What a constructor that throws has taken.
  void release_after_failure();

  const FileRendezvous& rendezvous_;
  std::string name_;
  size_t bytes_;
  int rank_;
  std::vector<void*> peers_;
  void** device_table_ = nullptr;
  std::chrono::milliseconds timeout_;
  SymmetricBackend backend_;
  bool peers_abandoned_ = false;
};

}  // namespace megamoe::comm
