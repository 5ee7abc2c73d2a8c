// Symmetric memory: one buffer of the same size on every rank of one node, each rank's kernels
// reading and writing every peer's copy through plain pointers over NVLink.
//
// Backend: CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle), handles exchanged through the
// FileRendezvous. Why not NVSHMEM here: within one node IPC needs nothing beyond the CUDA runtime
// and no bootstrap of its own, and our kernels only need peer pointers, not NVSHMEM's device
// API. Multi-node expert parallelism will put NVSHMEM's symmetric heap behind this same interface.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm/rendezvous.hpp"

namespace megamoe::comm {

class SymmetricMemory {
 public:
  // Collective: every rank calls it with the same name and size, on its current device: one GPU
  // per rank, or several ranks (processes) sharing one GPU, whose buffers then map through CUDA
  // IPC on that device. Zero-fills the buffer. Throws megamoe::Error when a peer on another GPU
  // is not reachable by P2P or does not arrive within `timeout`.
  SymmetricMemory(const FileRendezvous& rendezvous, const std::string& name, size_t bytes,
                  std::chrono::milliseconds timeout);
  // Collective as well: waits until every rank has closed its mappings before freeing, unless the
  // peers were abandoned.
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

 private:
  const FileRendezvous& rendezvous_;
  std::string name_;
  size_t bytes_;
  int rank_;
  std::vector<void*> peers_;
  void** device_table_ = nullptr;
  std::chrono::milliseconds timeout_;
  bool peers_abandoned_ = false;
};

}  // namespace megamoe::comm
