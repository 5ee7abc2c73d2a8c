#include "comm/nvshmem_heap.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "kernels/cuda_check.hpp"
#include "megamoe/error.hpp"

#if MEGAMOE_HAVE_NVSHMEM
// The host library's API only: megamoe's kernels use no NVSHMEM device code.
#define NVSHMEM_HOSTLIB_ONLY
#include <nvshmem_host.h>

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>
#endif

namespace megamoe::comm::nvshmem_heap {

#if MEGAMOE_HAVE_NVSHMEM

namespace {

// The host library's entry points megamoe calls, resolved from the library opened at first use
// (the declarations come from NVSHMEM's headers, so the types are the build's NVSHMEM's).
struct HostLibrary {
  decltype(&nvshmemx_get_uniqueid) get_uniqueid = nullptr;
  decltype(&nvshmemx_set_attr_uniqueid_args) set_attr_uniqueid_args = nullptr;
  decltype(&nvshmemx_hostlib_init_attr) hostlib_init_attr = nullptr;
  decltype(&nvshmem_my_pe) my_pe = nullptr;
  decltype(&nvshmem_n_pes) n_pes = nullptr;
  decltype(&nvshmem_malloc) malloc = nullptr;
  decltype(&nvshmem_ptr) ptr = nullptr;
  decltype(&nvshmem_free) free = nullptr;
};

template <typename Function>
void resolve(void* handle, const char* symbol, Function& entry) {
  entry = reinterpret_cast<Function>(dlsym(handle, symbol));
  if (entry == nullptr) {
    throw Error(ErrorCode::unsupported, std::string("NVSHMEM's host library has no ") + symbol +
                                            " (an NVSHMEM older than 3.0?)");
  }
}

// Opens the library the build found, else whatever the loader finds under its soname.
HostLibrary open_host_library() {
  void* handle = dlopen(MEGAMOE_NVSHMEM_HOST_LIBRARY, RTLD_NOW | RTLD_GLOBAL);
  std::string why = handle ? "" : dlerror();
  if (handle == nullptr) handle = dlopen("libnvshmem_host.so.3", RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    throw Error(ErrorCode::unsupported, "NVSHMEM's host library could not be opened: " + why + "; " + dlerror() +
                                            " (install nvidia-nvshmem-cu13, or put libnvshmem_host.so.3 on "
                                            "LD_LIBRARY_PATH)");
  }
  HostLibrary library;
  resolve(handle, "nvshmemx_get_uniqueid", library.get_uniqueid);
  resolve(handle, "nvshmemx_set_attr_uniqueid_args", library.set_attr_uniqueid_args);
  resolve(handle, "nvshmemx_hostlib_init_attr", library.hostlib_init_attr);
  resolve(handle, "nvshmem_my_pe", library.my_pe);
  resolve(handle, "nvshmem_n_pes", library.n_pes);
  resolve(handle, "nvshmem_malloc", library.malloc);
  resolve(handle, "nvshmem_ptr", library.ptr);
  resolve(handle, "nvshmem_free", library.free);
  return library;
}

// The NVSHMEM job this process joined (one per process, for the process' lifetime).
struct Job {
  bool joined = false;
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;  // what rank 0 drew for it: the job's name
  int pe = -1;
  int pes = 0;
  std::string failure;  // why initializing it failed, once it was attempted: NVSHMEM cannot be retried
  HostLibrary library;
};

std::mutex job_mutex;
Job job;

// What a rank says about its process before each allocation.
struct JobRecord {
  int32_t joined;
  int32_t pe;
  int32_t pes;
  nvshmemx_uniqueid_t id;
};

// Collective: returns once this process belongs to the same NVSHMEM job as every other rank of
// `rendezvous`, as the PE numbered like its rank, joining it first where no rank's process belongs
// to one; throws the same error on every rank otherwise. Keys are `name`'s, used once each.
void join(const FileRendezvous& rendezvous, const std::string& name, std::chrono::milliseconds timeout) {
  if (!job.failure.empty()) {
    throw Error(ErrorCode::unsupported, "NVSHMEM failed to initialize in this process earlier (" + job.failure +
                                            "); it cannot be initialized again");
  }
  JobRecord mine{};
  if (job.joined) mine = JobRecord{1, job.pe, job.pes, job.id};
  std::vector<uint8_t> bytes(sizeof mine);
  std::memcpy(bytes.data(), &mine, sizeof mine);
  const std::vector<std::vector<uint8_t>> published = rendezvous.exchange("nvshmem-job-" + name, bytes, timeout);
  std::vector<JobRecord> records(published.size());
  int joined = 0;
  bool one_job = true;
  std::string described;
  for (size_t r = 0; r < published.size(); ++r) {
    if (published[r].size() != sizeof(JobRecord)) {
      throw Error(ErrorCode::invalid_argument, "rank " + std::to_string(r) + " published an NVSHMEM job record of " +
                                                   std::to_string(published[r].size()) + " bytes, not " +
                                                   std::to_string(sizeof(JobRecord)) + " (another NVSHMEM version?)");
    }
    std::memcpy(&records[r], published[r].data(), sizeof(JobRecord));
    const bool rank0s_job = std::memcmp(&records[r].id, &records[0].id, sizeof(nvshmemx_uniqueid_t)) == 0;
    joined += records[r].joined != 0;
    one_job = one_job && records[r].joined != 0 && records[r].pe == static_cast<int>(r) &&
              records[r].pes == rendezvous.world_size() && rank0s_job;
    described += (r == 0 ? "" : "; ") + std::string("rank ") + std::to_string(r) +
                 (records[r].joined ? ": PE " + std::to_string(records[r].pe) + " of " +
                                          std::to_string(records[r].pes) +
                                          (rank0s_job ? " of rank 0's job" : " of another job")
                                    : ": in no job");
  }
  if (one_job) return;
  if (joined > 0) {
    throw Error(ErrorCode::unsupported,
                "NVSHMEM allows one job per process, and the ranks of rendezvous '" + rendezvous.directory() +
                    "' are not one job whose PEs are numbered as the ranks (" + described +
                    "): every NVSHMEM buffer of a process must be shared by the same ranks");
  }
  const HostLibrary library = open_host_library();
  // megamoe never uses NVLink multicast; keep NVSHMEM's collectives off it unless the user chose.
  setenv("NVSHMEM_DISABLE_NVLS", "1", /*overwrite=*/0);
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  std::vector<uint8_t> drawn;
  if (rendezvous.rank() == 0) {
    if (library.get_uniqueid(&id) != 0) {
      throw Error(ErrorCode::unsupported, "NVSHMEM could not draw a unique id on rank 0 (NVSHMEM_DEBUG=INFO says why)");
    }
    drawn.resize(sizeof id);
    std::memcpy(drawn.data(), &id, sizeof id);
  }
  // NVSHMEM's own bootstrap waits without a limit: enter it only once every rank is here (the
  // exchange of rank 0's id is that barrier).
  const std::vector<uint8_t> from_rank0 = rendezvous.exchange("nvshmem-unique-id-" + name, drawn, timeout)[0];
  if (from_rank0.size() != sizeof id) {
    throw Error(ErrorCode::invalid_argument, "rank 0 published an NVSHMEM unique id of " +
                                                 std::to_string(from_rank0.size()) + " bytes, not " +
                                                 std::to_string(sizeof id) + " (another NVSHMEM version?)");
  }
  std::memcpy(&id, from_rank0.data(), sizeof id);
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (library.set_attr_uniqueid_args(rendezvous.rank(), rendezvous.world_size(), &id, &attr) != 0) {
    throw Error(ErrorCode::invalid_argument, "NVSHMEM refused the unique-id arguments (rank " +
                                                 std::to_string(rendezvous.rank()) + " of " +
                                                 std::to_string(rendezvous.world_size()) + ")");
  }
  const int status = library.hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (status != 0) {
    job.failure = "status " + std::to_string(status) + " on rank " + std::to_string(rendezvous.rank());
    throw Error(ErrorCode::unsupported, "NVSHMEM failed to initialize on rank " + std::to_string(rendezvous.rank()) +
                                            " (status " + std::to_string(status) +
                                            "; NVSHMEM_DEBUG=INFO says why)");
  }
  if (library.my_pe() != rendezvous.rank() || library.n_pes() != rendezvous.world_size()) {
    job.failure = "numbered PE " + std::to_string(library.my_pe()) + " of " + std::to_string(library.n_pes()) +
                  " as rank " + std::to_string(rendezvous.rank()) + " of " + std::to_string(rendezvous.world_size());
    throw Error(ErrorCode::unsupported, "NVSHMEM " + job.failure);
  }
  job.joined = true;
  job.id = id;
  job.pe = rendezvous.rank();
  job.pes = rendezvous.world_size();
  job.library = library;
}

}  // namespace

bool built() { return true; }
void require_built() {}

void* allocate(const FileRendezvous& rendezvous, const std::string& name, size_t bytes,
               std::chrono::milliseconds timeout) {
  const std::lock_guard<std::mutex> lock(job_mutex);
  join(rendezvous, name, timeout);
  // nvshmem_malloc is collective and waits without a limit: every rank enters it, or none.
  rendezvous.barrier("nvshmem-malloc-" + name, timeout);
  void* local = job.library.malloc(bytes);
  // Every rank learns whether all got their copy, and all fail together where one did not (the
  // copies that were allocated stay on the heap: freeing them is collective).
  const std::vector<std::vector<uint8_t>> allocated =
      rendezvous.exchange("nvshmem-allocated-" + name, {static_cast<uint8_t>(local != nullptr)}, timeout);
  for (size_t r = 0; r < allocated.size(); ++r) {
    if (allocated[r] != std::vector<uint8_t>{1}) {
      throw Error(ErrorCode::out_of_memory, "nvshmem_malloc of " + std::to_string(bytes) + " bytes failed on rank " +
                                                std::to_string(r) +
                                                " (the symmetric heap's limit: NVSHMEM_SYMMETRIC_SIZE, or "
                                                "NVSHMEM_MAX_MEMORY_PER_GPU where the heap grows)");
    }
  }
  MEGAMOE_CUDA_CHECK(cudaMemset(local, 0, bytes));
  return local;
}

void* peer_pointer(void* local, int peer) {
  const std::lock_guard<std::mutex> lock(job_mutex);
  return job.library.ptr(local, peer);
}

void release(void* local, bool every_rank_frees) {
  const std::lock_guard<std::mutex> lock(job_mutex);
  if (local != nullptr && every_rank_frees) job.library.free(local);
}

#else  // !MEGAMOE_HAVE_NVSHMEM

bool built() { return false; }
void require_built() {
  throw Error(ErrorCode::unsupported,
              "this build of megamoe has no NVSHMEM: configure with -DMEGAMOE_NVSHMEM=ON where the "
              "nvidia-nvshmem-cu13 package (PyTorch's dependency) or -DNVSHMEM_ROOT is found, or use "
              "SymmetricBackend::cuda_ipc");
}
void* allocate(const FileRendezvous&, const std::string&, size_t, std::chrono::milliseconds) {
  require_built();
  return nullptr;
}
void* peer_pointer(void*, int) {
  require_built();
  return nullptr;
}
void release(void*, bool) {}

#endif

}  // namespace megamoe::comm::nvshmem_heap
