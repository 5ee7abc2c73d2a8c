// One rank of the multi-process rendezvous test, started by megamoe-run: rank 0 publishes an id,
// every rank reads it, publishes its own greeting, reads every other rank's, and meets the others
// at a barrier. Exits non-zero (megamoe-run then fails the run) on any mismatch or timeout.
#include <chrono>
#include <cstdio>
#include <string>

#include "comm/rendezvous.hpp"
#include "megamoe/error.hpp"

int main() {
  using namespace std::chrono_literals;
  try {
    const auto rendezvous = megamoe::comm::FileRendezvous::from_environment();
    const int rank = rendezvous.rank();
    const std::string id = "id-from-rank-0";
    if (rank == 0) rendezvous.publish("unique_id", std::vector<uint8_t>(id.begin(), id.end()));
    const std::vector<uint8_t> got = rendezvous.wait("unique_id", 10000ms);
    if (std::string(got.begin(), got.end()) != id) {
      std::fprintf(stderr, "rank %d read a wrong id\n", rank);
      return 1;
    }
    const std::string mine = "hello-" + std::to_string(rank);
    rendezvous.publish("greeting" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
    for (int r = 0; r < rendezvous.world_size(); ++r) {
      const std::vector<uint8_t> greeting = rendezvous.wait("greeting" + std::to_string(r), 10000ms);
      if (std::string(greeting.begin(), greeting.end()) != "hello-" + std::to_string(r)) {
        std::fprintf(stderr, "rank %d read a wrong greeting from rank %d\n", rank, r);
        return 1;
      }
    }
    rendezvous.barrier("done", 10000ms);
    std::printf("rank %d ok\n", rank);
    return 0;
  } catch (const megamoe::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
