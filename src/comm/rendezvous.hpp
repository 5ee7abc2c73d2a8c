// Bootstrap exchange between the ranks of one machine through a shared folder: rank 0 publishes
// an id (an NVSHMEM unique id, say) and the others read it. Every wait has a timeout whose error
// names the rank, the key and what was missing. megamoe-run creates the folder and passes it in
// MEGAMOE_RENDEZVOUS_DIR; multi-node bootstrap belongs to NVSHMEM, not here.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace megamoe::comm {

class FileRendezvous {
 public:
  FileRendezvous(std::string directory, int rank, int world_size);

  // From MEGAMOE_RENDEZVOUS_DIR, RANK and WORLD_SIZE; throws megamoe::Error naming what is unset or
  // not a number.
  static FileRendezvous from_environment();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& directory() const { return directory_; }

  // Makes `value` visible under `key` at once and whole (written aside, then renamed).
  void publish(const std::string& key, const std::vector<uint8_t>& value) const;

  // Waits until `key` exists and returns its value; throws megamoe::Error after `timeout`
  // (milliseconds::max(): no limit).
  std::vector<uint8_t> wait(const std::string& key, std::chrono::milliseconds timeout) const;

  // Publishes this rank's `value` under `name` and returns every rank's, in rank order, once each
  // has published; throws megamoe::Error after `timeout`, listing the ranks that never did. Each
  // name may be used once.
  std::vector<std::vector<uint8_t>> exchange(const std::string& name, const std::vector<uint8_t>& value,
                                             std::chrono::milliseconds timeout) const;

  // Returns once every rank has entered the barrier `name` (an exchange of nothing); throws
  // megamoe::Error after `timeout`, listing the ranks that never arrived. Each name may be used once.
  void barrier(const std::string& name, std::chrono::milliseconds timeout) const;
  // This rank's entry into the barrier (or exchange) `name` without waiting for the others (a rank
  // that will not wait still lets theirs complete), with `value` as its record.
  void arrive(const std::string& name, const std::vector<uint8_t>& value = {}) const;

 private:
  std::string path_of(const std::string& key) const;

  std::string directory_;
  int rank_;
  int world_size_;
};

}  // namespace megamoe::comm
