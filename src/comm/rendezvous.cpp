#include "comm/rendezvous.hpp"

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "megamoe/error.hpp"

namespace megamoe::comm {
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(2);

// RANK or WORLD_SIZE, all of it a decimal number: atoi would take "abc" for rank 0 (a second rank 0,
// found out only when a barrier stalls) and "1x" for 1.
int environment_int(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) {
    throw Error(ErrorCode::invalid_argument,
                std::string(name) + " is not set; start the ranks with megamoe-run (or torchrun-style variables)");
  }
  const std::string text = value;
  const bool digits_only = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  errno = 0;
  const long long number = digits_only ? std::strtoll(text.c_str(), nullptr, 10) : -1;
  if (!digits_only || errno == ERANGE || number > INT_MAX) {
    throw Error(ErrorCode::invalid_argument,
                std::string(name) + "='" + text + "' must be a non-negative integer up to " + std::to_string(INT_MAX));
  }
  return static_cast<int>(number);
}

// When a wait that began at `start` gives up: `timeout` after it, or never where that is past
// what the clock can hold (milliseconds::max() as "no timeout" would overflow into the past).
std::chrono::steady_clock::time_point deadline_after(std::chrono::steady_clock::time_point start,
                                                     std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - start);
  return timeout >= room ? Clock::time_point::max() : start + timeout;
}

bool valid_key(const std::string& key) {
  if (key.empty()) return false;
  for (char c : key)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) return false;
  return key[0] != '.';
}

}  // namespace

FileRendezvous::FileRendezvous(std::string directory, int rank, int world_size)
    : directory_(std::move(directory)), rank_(rank), world_size_(world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw Error(ErrorCode::invalid_argument,
                "rank " + std::to_string(rank) + " is outside a world of " + std::to_string(world_size));
  }
  if (!std::filesystem::is_directory(directory_)) {
    throw Error(ErrorCode::invalid_argument, "rendezvous folder '" + directory_ + "' does not exist");
  }
}

FileRendezvous FileRendezvous::from_environment() {
  const char* directory = std::getenv("MEGAMOE_RENDEZVOUS_DIR");
  if (directory == nullptr) {
    throw Error(ErrorCode::invalid_argument, "MEGAMOE_RENDEZVOUS_DIR is not set; start the ranks with megamoe-run");
  }
  return FileRendezvous(directory, environment_int("RANK"), environment_int("WORLD_SIZE"));
}

std::string FileRendezvous::path_of(const std::string& key) const {
  if (!valid_key(key)) {
    throw Error(ErrorCode::invalid_argument, "rendezvous key '" + key + "' must be letters, digits, '_', '-', '.'");
  }
  return directory_ + "/" + key;
}

void FileRendezvous::publish(const std::string& key, const std::vector<uint8_t>& value) const {
  const std::string path = path_of(key);
  const std::string staging = path + ".tmp-rank" + std::to_string(rank_);
  {
    std::ofstream file(staging, std::ios::binary);
    file.write(reinterpret_cast<const char*>(value.data()), static_cast<std::streamsize>(value.size()));
    if (!file) throw Error(ErrorCode::invalid_argument, "cannot write " + staging);
  }
  std::filesystem::rename(staging, path);  // atomic: readers see nothing or everything
}

std::vector<uint8_t> FileRendezvous::wait(const std::string& key, std::chrono::milliseconds timeout) const {
  const std::string path = path_of(key);
  const auto deadline = deadline_after(std::chrono::steady_clock::now(), timeout);
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw Error(ErrorCode::timeout, "rank " + std::to_string(rank_) + " waited " +
                                                   std::to_string(timeout.count()) + " ms for '" + key + "' in " +
                                                   directory_ + " and it never appeared");
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  std::ifstream file(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

void FileRendezvous::arrive(const std::string& name, const std::vector<uint8_t>& value) const {
  publish(name + ".rank" + std::to_string(rank_), value);
}

std::vector<std::vector<uint8_t>> FileRendezvous::exchange(const std::string& name, const std::vector<uint8_t>& value,
                                                           std::chrono::milliseconds timeout) const {
  publish(name + ".rank" + std::to_string(rank_), value);
  const auto deadline = deadline_after(std::chrono::steady_clock::now(), timeout);
  std::vector<std::vector<uint8_t>> values(world_size_);
  for (int r = 0; r < world_size_; ++r) {
    while (!std::filesystem::exists(path_of(name + ".rank" + std::to_string(r)))) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::string missing;
        for (int m = 0; m < world_size_; ++m) {
          if (!std::filesystem::exists(path_of(name + ".rank" + std::to_string(m)))) {
            missing += (missing.empty() ? "" : ", ") + std::to_string(m);
          }
        }
        throw Error(ErrorCode::timeout, "barrier '" + name + "': rank " + std::to_string(rank_) + " waited " +
                                                     std::to_string(timeout.count()) + " ms; rank(s) " + missing +
                                                     " never arrived");
      }
      std::this_thread::sleep_for(kPollInterval);
    }
    std::ifstream file(path_of(name + ".rank" + std::to_string(r)), std::ios::binary);
    values[r].assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  }
  return values;
}

void FileRendezvous::barrier(const std::string& name, std::chrono::milliseconds timeout) const {
  exchange(name, {}, timeout);
}

}  // namespace megamoe::comm
