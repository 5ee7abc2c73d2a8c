#include "comm/rendezvous.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

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

TEST_F(Rendezvous, AnExchangeGivesEveryRankEveryValueInRankOrder) {
  test::SeededRng rng;
  constexpr int kRanks = 3;
  std::vector<std::vector<uint8_t>> values(kRanks);
  for (int r = 0; r < kRanks; ++r) values[r].resize(static_cast<size_t>(rng.integer(0, 40)), static_cast<uint8_t>(r + 1));
  std::vector<std::vector<std::vector<uint8_t>>> seen(kRanks);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      std::this_thread::sleep_for(std::chrono::milliseconds(10 * (kRanks - r)));  // the last rank comes first
      seen[r] = FileRendezvous(directory_, r, kRanks).exchange("records", values[r], 5000ms);
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(seen[r], values) << "rank " << r;
  try {
    FileRendezvous(directory_, 0, 2).exchange("alone", {7}, 40ms);
    FAIL() << "the exchange returned without rank 1's value";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    EXPECT_NE(std::string(e.what()).find("rank(s) 1 never arrived"), std::string::npos) << e.what();
  }
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

// The error a throwing `call` gives, or "" when it returns.
template <class Call>
std::string error_of(Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST_F(Rendezvous, ATimeoutTooLongToAddToTheClockMeansWaitingForever) {
  // milliseconds::max() as "no timeout": the deadline must not overflow into the past.
  const FileRendezvous rank0(directory_, 0, 2), rank1(directory_, 1, 2);
  std::thread publisher([&] {
    std::this_thread::sleep_for(50ms);
    rank1.publish("late", {7});
    rank1.arrive("met");
  });
  std::vector<uint8_t> value;
  EXPECT_EQ(error_of([&] { value = rank0.wait("late", std::chrono::milliseconds::max()); }), "");
  EXPECT_EQ(value, (std::vector<uint8_t>{7}));
  EXPECT_EQ(error_of([&] { rank0.barrier("met", std::chrono::milliseconds::max()); }), "");
  publisher.join();
}

// Sets the variables from_environment reads for one test, and restores them.
class RendezvousEnvironment : public Rendezvous {
 protected:
  void SetUp() override {
    Rendezvous::SetUp();
    for (const char* name : {"MEGAMOE_RENDEZVOUS_DIR", "RANK", "WORLD_SIZE"}) {
      const char* value = std::getenv(name);
      saved_.emplace_back(name, value ? std::optional<std::string>(value) : std::nullopt);
    }
    setenv("MEGAMOE_RENDEZVOUS_DIR", directory_.c_str(), 1);
  }
  void TearDown() override {
    for (const auto& [name, value] : saved_) {
      if (value) setenv(name.c_str(), value->c_str(), 1);
      else unsetenv(name.c_str());
    }
    Rendezvous::TearDown();
  }
  // The error from_environment gives for RANK=rank and WORLD_SIZE=world, or "" when it accepts them.
  std::string error_for(const char* rank, const char* world) {
    setenv("RANK", rank, 1);
    setenv("WORLD_SIZE", world, 1);
    return error_of([] { FileRendezvous::from_environment(); });
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST_F(RendezvousEnvironment, RefusesVariablesThatAreNotNumbersNamingThem) {
  // atoi would read "abc" as rank 0 (a second rank 0) and "1x" as 1.
  for (const char* bad : {"abc", "1x", "", " 1", "-", "99999999999"}) {
    const std::string error = error_for(bad, "2");
    EXPECT_NE(error.find("RANK='" + std::string(bad) + "' must be a non-negative integer"), std::string::npos)
        << "RANK='" << bad << "': " << error;
  }
  const std::string error = error_for("0", "two");
  EXPECT_NE(error.find("WORLD_SIZE='two' must be a non-negative integer"), std::string::npos) << error;
  EXPECT_NE(error_for("2", "2").find("rank 2 is outside a world of 2"), std::string::npos);
  EXPECT_EQ(error_for("1", "2"), "");
}

}  // namespace
}  // namespace megamoe::comm
