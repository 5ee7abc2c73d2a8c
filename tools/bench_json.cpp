#include "bench_json.hpp"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace megamoe::bench {
namespace {

void escape(std::string& out, const std::string& text) {
  out += '"';
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buffer[8];
          std::snprintf(buffer, sizeof buffer, "\\u%04x", c);
          out += buffer;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

// `arg` as a POSIX shell reads it back: unchanged when it holds only safe characters, else in
// single quotes.
std::string shell_quoted(const std::string& arg) {
  const bool safe = !arg.empty() && arg.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                          "0123456789_-+=/.,:@%") == std::string::npos;
  if (safe) return arg;
  std::string quoted = "'";
  for (char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

}  // namespace

Json Json::object() { return Json(); }
Json Json::array() {
  Json j;
  j.kind_ = Kind::array;
  return j;
}
Json::Json(double number) : kind_(Kind::number), number_(number) {}
Json::Json(long long number) : kind_(Kind::integer), integer_(number) {}
Json::Json(uint64_t number) : kind_(Kind::unsigned_integer), unsigned_integer_(number) {}
Json::Json(bool flag) : kind_(Kind::boolean), boolean_(flag) {}
Json::Json(std::string text) : kind_(Kind::string), text_(std::move(text)) {}

Json& Json::set(const std::string& key, Json value) {
  members_.emplace_back(key, std::move(value));
  return *this;
}

Json& Json::push(Json value) {
  members_.emplace_back(std::string(), std::move(value));
  return *this;
}

std::string Json::dump(int indent) const {
  std::string out;
  write(out, indent, 0);
  out += '\n';
  return out;
}

void Json::write(std::string& out, int indent, int depth) const {
  switch (kind_) {
    case Kind::number: {
      if (!std::isfinite(number_)) {
        out += "null";  // JSON has no NaN or infinity
        return;
      }
      char buffer[32];
      std::snprintf(buffer, sizeof buffer, "%.6g", number_);
      out += buffer;
      return;
    }
    case Kind::integer: out += std::to_string(integer_); return;
    case Kind::unsigned_integer: out += std::to_string(unsigned_integer_); return;
    case Kind::boolean: out += boolean_ ? "true" : "false"; return;
    case Kind::string: escape(out, text_); return;
    case Kind::object:
    case Kind::array: break;
  }
  const bool is_object = kind_ == Kind::object;
  out += is_object ? '{' : '[';
  const std::string pad(static_cast<size_t>(indent) * (depth + 1), ' ');
  for (size_t i = 0; i < members_.size(); ++i) {
    out += i ? ",\n" : "\n";
    out += pad;
    if (is_object) {
      escape(out, members_[i].first);
      out += ": ";
    }
    members_[i].second.write(out, indent, depth + 1);
  }
  if (!members_.empty()) out += "\n" + std::string(static_cast<size_t>(indent) * depth, ' ');
  out += is_object ? '}' : ']';
}

void write_json_file(const std::string& path, const Json& json) {
  const std::filesystem::path target(path);
  if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path());
  std::ofstream file(target);
  file << json.dump();
  if (!file) throw std::runtime_error("cannot write " + path);
}

#ifndef MEGAMOE_VERSION
#define MEGAMOE_VERSION "unknown (built without -DMEGAMOE_VERSION)"
#endif

Provenance provenance_of_run(int argc, char** argv) {
  Provenance p;
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  char date[32] = "unknown";
  if (now != static_cast<std::time_t>(-1) && gmtime_r(&now, &utc) != nullptr) {
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
  }
  p.date = date;
  for (int i = 0; i < argc; ++i) p.command += (i ? " " : "") + shell_quoted(argv[i]);
  p.megamoe_version = MEGAMOE_VERSION;
  return p;
}

Json& set_provenance(Json& record, const Provenance& provenance) {
  return record.set("date", provenance.date)
      .set("command", provenance.command)
      .set("megamoe_version", provenance.megamoe_version);
}

}  // namespace megamoe::bench
