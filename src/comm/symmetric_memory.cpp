#include "comm/symmetric_memory.hpp"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda_check.hpp"
#include "megamoe/error.hpp"

namespace megamoe::comm {

SymmetricMemory::SymmetricMemory(const FileRendezvous& rendezvous, const std::string& name, size_t bytes,
                                 std::chrono::milliseconds timeout)
    : rendezvous_(rendezvous), name_(name), bytes_(bytes), rank_(rendezvous.rank()),
      peers_(rendezvous.world_size(), nullptr), timeout_(timeout) {
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&peers_[rank_], bytes));
  MEGAMOE_CUDA_CHECK(cudaMemset(peers_[rank_], 0, bytes));
  cudaIpcMemHandle_t handle;
  MEGAMOE_CUDA_CHECK(cudaIpcGetMemHandle(&handle, peers_[rank_]));
  // The size too: ranks that carve different layouts out of their buffers would write past each other's.
  const uint64_t size = bytes;
  std::vector<uint8_t> mine(sizeof handle + sizeof device + sizeof size);
  std::memcpy(mine.data(), &handle, sizeof handle);
  std::memcpy(mine.data() + sizeof handle, &device, sizeof device);
  std::memcpy(mine.data() + sizeof handle + sizeof device, &size, sizeof size);
  rendezvous_.publish("symm-" + name_ + "-rank" + std::to_string(rank_), mine);
  for (int r = 0; r < world_size(); ++r) {
    if (r == rank_) continue;
    const std::vector<uint8_t> theirs = rendezvous_.wait("symm-" + name_ + "-rank" + std::to_string(r), timeout_);
    if (theirs.size() != mine.size()) {
      throw Error(ErrorCode::invalid_argument, "symmetric memory '" + name_ + "': rank " + std::to_string(r) +
                                                   " published a malformed handle");
    }
    int peer_device = 0;
    uint64_t peer_size = 0;
    std::memcpy(&handle, theirs.data(), sizeof handle);
    std::memcpy(&peer_device, theirs.data() + sizeof handle, sizeof peer_device);
    std::memcpy(&peer_size, theirs.data() + sizeof handle + sizeof peer_device, sizeof peer_size);
    if (peer_size != size) {
      throw Error(ErrorCode::invalid_argument, "symmetric memory '" + name_ + "': rank " + std::to_string(r) + " has " +
                                                   std::to_string(peer_size) + " bytes where rank " +
                                                   std::to_string(rank_) + " has " + std::to_string(size) +
                                                   " (the ranks' layers differ: shapes, max_tokens or token_rows)");
    }
    // A rank on the same GPU (ranks sharing one device) needs no peer access, only the IPC mapping.
    int can_access = peer_device == device ? 1 : 0;
    if (peer_device != device) MEGAMOE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_access, device, peer_device));
    if (!can_access) {
      throw Error(ErrorCode::unsupported, "rank " + std::to_string(rank_) + " (GPU " + std::to_string(device) +
                                              ") cannot access GPU " + std::to_string(peer_device) + " of rank " +
                                              std::to_string(r) + " peer to peer; expert parallelism needs NVLink P2P");
    }
    MEGAMOE_CUDA_CHECK(cudaIpcOpenMemHandle(&peers_[r], handle, cudaIpcMemLazyEnablePeerAccess));
  }
  MEGAMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device_table_), sizeof(void*) * world_size()));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpy(device_table_, peers_.data(), sizeof(void*) * world_size(), cudaMemcpyHostToDevice));
  rendezvous_.barrier("symm-" + name_ + "-mapped", timeout_);
}

SymmetricMemory::~SymmetricMemory() {
  const bool healthy = cudaDeviceSynchronize() == cudaSuccess;
  for (int r = 0; r < world_size(); ++r)
    if (r != rank_ && peers_[r]) cudaIpcCloseMemHandle(peers_[r]);
  // Once a peer was lost, or after a device fault, the peers are not coming: leave at once (a lost
  // peer's survivors still let a peer that is alive pass its closing barrier).
  const std::string closed = "symm-" + name_ + "-closed";
  if (peers_abandoned_) {
    rendezvous_.arrive(closed);
  } else if (healthy) {
    try {
      rendezvous_.barrier(closed, timeout_);
    } catch (const Error&) {
      // A peer that died cannot unmap; freeing our copy is still right.
    }
  }
  cudaFree(device_table_);
  cudaFree(peers_[rank_]);
}

}  // namespace megamoe::comm
