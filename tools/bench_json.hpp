// A small ordered JSON writer for bench records: objects of numbers, strings, bools and nested
// values, written with stable key order so committed results diff cleanly.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace megamoe::bench {

class Json {
 public:
  static Json object();
  static Json array();
  Json(double number);
  Json(long long number);
  Json(int number) : Json(static_cast<long long>(number)) {}
  Json(uint64_t number);  // a seed: all 64 bits, as given (a long long would turn the top half negative)
  Json(bool flag);
  Json(std::string text);
  Json(const char* text) : Json(std::string(text)) {}

  Json& set(const std::string& key, Json value);  // objects
  Json& push(Json value);                         // arrays
  std::string dump(int indent = 2) const;

 private:
  enum class Kind { object, array, number, integer, unsigned_integer, boolean, string };
  Json() = default;
  void write(std::string& out, int indent, int depth) const;

  Kind kind_ = Kind::object;
  double number_ = 0;
  long long integer_ = 0;
  uint64_t unsigned_integer_ = 0;
  bool boolean_ = false;
  std::string text_;
  std::vector<std::pair<std::string, Json>> members_;  // object members or array items (empty keys)
};

// Writes `json` to `path`, creating parent folders; throws std::runtime_error on failure.
void write_json_file(const std::string& path, const Json& json);

// Where a record comes from, for docs/performance.md: when the run started (UTC, ISO-8601), its
// command line as run (arguments quoted where a shell would need it) and the megamoe version
// (the CMake project version, compile definition MEGAMOE_VERSION).
struct Provenance {
  std::string date;
  std::string command;
  std::string megamoe_version;
};
Provenance provenance_of_run(int argc, char** argv);
// Adds "date", "command" and "megamoe_version" to the object `record`.
Json& set_provenance(Json& record, const Provenance& provenance);

}  // namespace megamoe::bench
