#include "comm/symmetric_memory.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "comm/nvshmem_heap.hpp"
#include "kernels/cuda_check.hpp"
#include "megamoe/error.hpp"

namespace megamoe::comm {

const char* to_string(SymmetricBackend backend) {
  switch (backend) {
    case SymmetricBackend::cuda_ipc: return "cuda_ipc";
    case SymmetricBackend::nvshmem: return "nvshmem";
  }
  return "unknown";
}

// What each rank publishes about its copy before any rank maps a peer's; a refusal (refusal_record)
// follows it where this rank refuses.
struct SymmetricMemory::PublishedCopy {
  cudaIpcMemHandle_t handle;  // cuda_ipc only
  int32_t device;
  int32_t backend;
  uint64_t bytes;  // ranks that carve different layouts out of their buffers would write past each other's
  char layout[kMaxLayoutChars + 1];  // or into each other's regions, with the same size
};

namespace {

// A rank's reason to refuse, for its peers: the error's code, then its message.
std::vector<uint8_t> refusal_record(const Error& e) {
  std::string why = e.what();
  const std::string prefix = std::string("megamoe: ") + to_string(e.code()) + ": ";
  if (why.rfind(prefix, 0) == 0) why.erase(0, prefix.size());
  std::vector<uint8_t> record(1 + why.size());
  record[0] = static_cast<uint8_t>(e.code());
  std::memcpy(record.data() + 1, why.data(), why.size());
  return record;
}

// After an exchange of records that end in a refusal where a rank refuses (from byte `offset` on):
// throws the first rank's, as every rank does, so that none goes on to wait for a peer that has
// given up.
void throw_first_refusal(const std::string& name, const std::vector<std::vector<uint8_t>>& records,
                         size_t offset = 0) {
  for (size_t r = 0; r < records.size(); ++r) {
    if (records[r].size() <= offset) continue;
    const std::string why(records[r].begin() + static_cast<long>(offset) + 1, records[r].end());
    throw Error(static_cast<ErrorCode>(records[r][offset]),
                "symmetric memory '" + name + "': rank " + std::to_string(r) + " refused: " + why);
  }
}

}  // namespace

SymmetricMemory::SymmetricMemory(const FileRendezvous& rendezvous, const std::string& name, size_t bytes,
                                 std::chrono::milliseconds timeout, SymmetricBackend backend,
                                 const std::string& layout)
    : rendezvous_(rendezvous), name_(name), bytes_(bytes), rank_(rendezvous.rank()),
      peers_(rendezvous.world_size(), nullptr), timeout_(timeout), backend_(backend) {
  // Refusals that are this rank's alone still go to the peers, which would otherwise wait for a
  // record that never comes.
  std::vector<uint8_t> refusal;
  if (backend != SymmetricBackend::cuda_ipc && backend != SymmetricBackend::nvshmem) {
    refusal = refusal_record(Error(ErrorCode::invalid_argument, "backend " + std::to_string(static_cast<int>(backend)) +
                                                                    " names no SymmetricBackend value (cuda_ipc, nvshmem)"));
  } else if (layout.size() > kMaxLayoutChars) {
    refusal = refusal_record(Error(ErrorCode::invalid_argument, "layout '" + layout + "' is longer than " +
                                                                    std::to_string(kMaxLayoutChars) + " characters"));
  } else if (backend == SymmetricBackend::nvshmem) {
    try {
      nvshmem_heap::require_built();
    } catch (const Error& e) {
      refusal = refusal_record(e);
    }
  }
  PublishedCopy mine{};
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  mine.device = device;
  mine.backend = static_cast<int32_t>(backend);
  mine.bytes = bytes;
  std::memcpy(mine.layout, layout.data(), std::min(layout.size(), kMaxLayoutChars));
  // With CUDA IPC the handle is published with the rest; NVSHMEM's allocation is collective and
  // comes after every rank has seen the others' sizes agree.
  if (backend == SymmetricBackend::cuda_ipc) {
    MEGAMOE_CUDA_CHECK(cudaMalloc(&peers_[rank_], bytes));
  }
  try {
    if (backend == SymmetricBackend::cuda_ipc) {
      MEGAMOE_CUDA_CHECK(cudaMemset(peers_[rank_], 0, bytes));
      MEGAMOE_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, peers_[rank_]));
    }
    map_peers(mine, refusal);
  } catch (...) {
    release_after_failure();
    throw;
  }
}

void SymmetricMemory::map_peers(const PublishedCopy& mine, const std::vector<uint8_t>& refusal) {
  std::vector<uint8_t> record(sizeof mine + refusal.size());
  std::memcpy(record.data(), &mine, sizeof mine);
  if (!refusal.empty()) std::memcpy(record.data() + sizeof mine, refusal.data(), refusal.size());
  const std::vector<std::vector<uint8_t>> records = rendezvous_.exchange("symm-" + name_ + "-copies", record, timeout_);
  std::vector<PublishedCopy> theirs(world_size());
  for (int r = 0; r < world_size(); ++r) {
    if (records[r].size() < sizeof(PublishedCopy)) {
      throw Error(ErrorCode::invalid_argument, "symmetric memory '" + name_ + "': rank " + std::to_string(r) +
                                                   " published a malformed record");
    }
    std::memcpy(&theirs[r], records[r].data(), sizeof(PublishedCopy));
  }
  throw_first_refusal(name_, records, sizeof(PublishedCopy));
  for (int r = 0; r < world_size(); ++r) {
    theirs[r].layout[kMaxLayoutChars] = '\0';
    if (std::strcmp(theirs[r].layout, mine.layout) != 0) {
      throw Error(ErrorCode::invalid_argument, "symmetric memory '" + name_ + "': rank " + std::to_string(r) +
                                                   " lays its buffer out as '" + theirs[r].layout + "' where rank " +
                                                   std::to_string(rank_) + " lays it out as '" + mine.layout +
                                                   "' (every rank must build the same layer)");
    }
    if (theirs[r].bytes != mine.bytes) {
      throw Error(ErrorCode::invalid_argument,
                  "symmetric memory '" + name_ + "': rank " + std::to_string(r) + " has " +
                      std::to_string(theirs[r].bytes) + " bytes where rank " + std::to_string(rank_) + " has " +
                      std::to_string(mine.bytes) +
                      " (the ranks' layers differ: shapes, max_tokens, token_rows or partial_sums)");
    }
    if (theirs[r].backend != mine.backend) {
      throw Error(ErrorCode::invalid_argument,
                  "symmetric memory '" + name_ + "': rank " + std::to_string(r) + " uses backend " +
                      to_string(static_cast<SymmetricBackend>(theirs[r].backend)) + " where rank " +
                      std::to_string(rank_) + " uses " + to_string(backend_) + " (every rank must use the same)");
    }
  }
  // Reaching the peers can fail on one rank only (no P2P to one GPU, a peer NVSHMEM reaches only
  // through a network): each rank says how it went before any goes on.
  std::vector<uint8_t> unreachable;
  try {
    if (backend_ == SymmetricBackend::cuda_ipc) {
      open_ipc_peers(theirs);
    } else {
      peers_[rank_] = nvshmem_heap::allocate(rendezvous_, name_, bytes_, timeout_);
      for (int r = 0; r < world_size(); ++r) {
        if (r == rank_) continue;
        peers_[r] = nvshmem_heap::peer_pointer(peers_[rank_], r);
        if (peers_[r] == nullptr) {
          throw Error(ErrorCode::unsupported,
                      "NVSHMEM reaches rank " + std::to_string(r) + " from rank " + std::to_string(rank_) +
                          " only through a network transport (another node, or a GPU without P2P); megamoe's "
                          "expert-parallel kernels need load/store access to every peer "
                          "(docs/design.md#nvshmem-symmetric-memory)");
        }
      }
    }
    MEGAMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device_table_), sizeof(void*) * world_size()));
    MEGAMOE_CUDA_CHECK(
        cudaMemcpy(device_table_, peers_.data(), sizeof(void*) * world_size(), cudaMemcpyHostToDevice));
  } catch (const Error& e) {
    unreachable = refusal_record(e);
  }
  throw_first_refusal(name_, rendezvous_.exchange("symm-" + name_ + "-mapped", unreachable, timeout_));
}

void SymmetricMemory::open_ipc_peers(const std::vector<PublishedCopy>& theirs) {
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  for (int r = 0; r < world_size(); ++r) {
    if (r == rank_) continue;
    const int peer_device = theirs[r].device;
    // A rank on the same GPU (ranks sharing one device) needs no peer access, only the IPC mapping.
    int can_access = peer_device == device ? 1 : 0;
    if (peer_device != device) MEGAMOE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_access, device, peer_device));
    if (!can_access) {
      throw Error(ErrorCode::unsupported, "rank " + std::to_string(rank_) + " (GPU " + std::to_string(device) +
                                              ") cannot access GPU " + std::to_string(peer_device) + " of rank " +
                                              std::to_string(r) + " peer to peer; expert parallelism needs NVLink P2P");
    }
    MEGAMOE_CUDA_CHECK(cudaIpcOpenMemHandle(&peers_[r], theirs[r].handle, cudaIpcMemLazyEnablePeerAccess));
  }
}

void SymmetricMemory::release_after_failure() {
  cudaFree(device_table_);
  if (backend_ == SymmetricBackend::cuda_ipc) {
    for (int r = 0; r < world_size(); ++r)
      if (r != rank_ && peers_[r]) cudaIpcCloseMemHandle(peers_[r]);
    cudaFree(peers_[rank_]);
  }
  // An NVSHMEM copy stays: its free is collective, and the peers are failing too.
}

SymmetricMemory::~SymmetricMemory() {
  const bool healthy = cudaDeviceSynchronize() == cudaSuccess;
  if (backend_ == SymmetricBackend::cuda_ipc) {
    for (int r = 0; r < world_size(); ++r)
      if (r != rank_ && peers_[r]) cudaIpcCloseMemHandle(peers_[r]);
  }
  // Closing: each rank says whether it frees its copy. Once a peer was lost, or after a device
  // fault, the peers are not coming: such a rank says no and leaves at once (its record still lets
  // the others through). A healthy rank waits for every record, so that no copy is freed while a
  // peer still maps it.
  const std::string closed = "symm-" + name_ + "-closed";
  const bool freeing = healthy && !peers_abandoned_;
  bool every_rank_frees = false;
  if (!freeing) {
    rendezvous_.arrive(closed, {0});
  } else {
    try {
      every_rank_frees = true;
      for (const std::vector<uint8_t>& record : rendezvous_.exchange(closed, {1}, timeout_))
        every_rank_frees = every_rank_frees && record == std::vector<uint8_t>{1};
    } catch (const Error&) {
      every_rank_frees = false;  // a peer that died cannot unmap; freeing an IPC copy is still right
    }
  }
  cudaFree(device_table_);
  if (backend_ == SymmetricBackend::cuda_ipc) {
    cudaFree(peers_[rank_]);
  } else {
    // NVSHMEM's free is collective: only where every rank frees too (else the heap goes with the
    // process).
    nvshmem_heap::release(peers_[rank_], every_rank_frees);
  }
}

}  // namespace megamoe::comm
