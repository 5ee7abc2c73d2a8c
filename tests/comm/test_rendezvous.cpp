#include "comm/rendezvous.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "common/test_random.hpp"
#include "megamoe/error.hpp"

namespace megamoe::comm {
namespace {

using namespace std::chrono_literals;

class Rendezvous : public ::testing::Test {
 protected:
  void SetUp() override {
    char name[] = "/tmp/megamoe-test-rendezvous-XXXXXX";
    directory_ = mkdtemp(name);
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }
  std::string directory_;
};

TEST_F(Rendezvous, RanksExchangeIdsAndMeetAtBarriers) {
  test::SeededRng rng;
  constexpr int kRanks = 4;
  std::vector<uint8_t> id(128);
  for (uint8_t& b : id) b = static_cast<uint8_t>(rng.integer(0, 255));
  std::vector<std::vector<uint8_t>> seen(kRanks);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      const FileRendezvous rendezvous(directory_, r, kRanks);
      if (r == 0) {
        std::this_thread::sleep_for(20ms);  // the others are already waiting
        rendezvous.publish("unique_id", id);
      }
      seen[r] = rendezvous.wait("unique_id", 5000ms);
      rendezvous.barrier("after_init", 5000ms);
      rendezvous.barrier("second", 5000ms);
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(seen[r], id) << "rank " << r;
}

TEST_F(Rendezvous, MissingPeersTimeOutWithADiagnostic) {
  const FileRendezvous rank1(directory_, 1, 3);
  try {
    rank1.barrier("init", 50ms);
    FAIL() << "the barrier returned without ranks 0 and 2";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    EXPECT_NE(std::string(e.what()).find("rank(s) 0, 2 never arrived"), std::string::npos) << e.what();
  }
  try {
    rank1.wait("unique_id", 30ms);
    FAIL() << "wait returned a key nobody published";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    EXPECT_NE(std::string(e.what()).find("rank 1 waited 30 ms for 'unique_id'"), std::string::npos) << e.what();
  }
}

TEST_F(Rendezvous, AnArrivalThatDoesNotWaitCompletesTheOthersBarrier) {
  // Rank 1 will not wait (it lost a peer), but ranks 0 and 2 must still get through.
  const FileRendezvous rank1(directory_, 1, 3);
  rank1.arrive("closed");
  std::thread rank0([&] { FileRendezvous(directory_, 0, 3).barrier("closed", 5000ms); });
  std::thread rank2([&] { FileRendezvous(directory_, 2, 3).barrier("closed", 5000ms); });
  rank0.join();
  rank2.join();
  // Without the arrival the same barrier times out naming rank 1.
  try {
    FileRendezvous(directory_, 0, 2).barrier("other", 50ms);
    FAIL() << "the barrier returned without rank 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank(s) 1 never arrived"), std::string::npos) << e.what();
  }
}

TEST_F(Rendezvous, RejectsBadArguments) {
  EXPECT_THROW(FileRendezvous(directory_, 3, 3), Error);
  EXPECT_THROW(FileRendezvous(directory_ + "/missing", 0, 1), Error);
  const FileRendezvous rendezvous(directory_, 0, 1);
  EXPECT_THROW(rendezvous.publish("../escape", {}), Error);
  EXPECT_THROW(rendezvous.publish("", {}), Error);
}

}  // namespace
}  // namespace megamoe::comm
