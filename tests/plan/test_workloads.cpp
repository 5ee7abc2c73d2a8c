// plan::find_workload: the named workloads, and a layer of the user's own shape written as
// "experts=E,top_k=K,hidden=H,intermediate=I", which the benchmarks take as --workload.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <variant>

#include "megamoe/error.hpp"
#include "plan/workloads.hpp"

namespace megamoe::plan {
namespace {

// The message find_workload refuses `name` with (it must refuse it as invalid_argument).
std::string refusal(const std::string& name) {
  try {
    find_workload(name);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << name;
    return e.what();
  }
  ADD_FAILURE() << "'" << name << "' was taken";
  return "";
}

TEST(Workloads, NamedOnesAreFound) {
  for (const Workload& w : named_workloads()) {
    const Workload found = find_workload(w.name);
    EXPECT_EQ(found.name, w.name);
    EXPECT_EQ(found.spec.num_experts, w.spec.num_experts);
    EXPECT_EQ(found.spec.hidden, w.spec.hidden);
  }
  EXPECT_EQ(find_workload("dsv3").spec.intermediate, 2048);
}

TEST(Workloads, AShapeInAnyOrderIsALayerOfThatShape) {
  for (const std::string name : {"experts=8,top_k=2,hidden=4096,intermediate=14336",
                                 "hidden=4096,intermediate=14336,top_k=2,experts=8"}) {
    SCOPED_TRACE(name);
    const Workload w = find_workload(name);
    EXPECT_EQ(w.name, name);
    EXPECT_EQ(w.spec.num_experts, 8);
    EXPECT_EQ(w.spec.top_k, 2);
    EXPECT_EQ(w.spec.hidden, 4096);
    EXPECT_EQ(w.spec.intermediate, 14336);
    ASSERT_TRUE(std::holds_alternative<SoftmaxTopK>(w.spec.routing));
    EXPECT_TRUE(std::get<SoftmaxTopK>(w.spec.routing).renormalize);
    validate(w.spec);  // a shape the layer can take passes the spec's own checks
  }
}

TEST(Workloads, AShapeSaysWhatItLacks) {
  const std::pair<const char*, const char*> cases[] = {
      {"experts=8,top_k=2,hidden=4096", "no intermediate"},
      {"experts=8", "no top_k, hidden, intermediate"},
      {"experts=8,top_k=2,hidden=4096,intermediate=14336,bias=1", "unknown key 'bias'"},
      {"experts=8,experts=8,top_k=2,hidden=4096,intermediate=14336", "experts given twice"},
      {"experts=8,top_k=two,hidden=4096,intermediate=14336", "top_k needs a non-negative integer"},
      {"experts=-8,top_k=2,hidden=4096,intermediate=14336", "got '-8'"},
      {"experts=8,top_k=2,hidden=4096,intermediate=99999999999", "at most 9 digits"},
      {"experts=8,top_k=2,hidden=4096,intermediate=14336,", "'' is not key=value"},
      {"experts=8,top_k,hidden=4096,intermediate=14336", "'top_k' is not key=value"},
  };
  for (const auto& [name, says] : cases) {
    const std::string message = refusal(name);
    EXPECT_NE(message.find(says), std::string::npos) << message;
    // Every refusal shows the form it wants.
    EXPECT_NE(message.find("experts=E,top_k=K,hidden=H,intermediate=I"), std::string::npos) << message;
  }
}

TEST(Workloads, AnUnknownNameListsTheNamesAndTheShapeForm) {
  const std::string message = refusal("mixtral");
  EXPECT_NE(message.find("unknown workload 'mixtral'; known: qwen35-a3b, qwen3-30b-a3b, dsv3"), std::string::npos);
  EXPECT_NE(message.find("experts=8,top_k=2,hidden=4096,intermediate=14336"), std::string::npos);
}

// The values are the spec's to judge: a shape the kernels cannot take parses, and validate says why.
TEST(Workloads, AShapesValuesAreJudgedByTheSpec) {
  MoeSpec spec = find_workload("experts=8,top_k=9,hidden=4096,intermediate=14336").spec;
  EXPECT_THROW(validate(spec), Error);
  spec = find_workload("experts=8,top_k=2,hidden=4000,intermediate=14336").spec;
  spec.precision = Precision::fp8_block;
  EXPECT_THROW(validate(spec), Error);
}

}  // namespace
}  // namespace megamoe::plan
