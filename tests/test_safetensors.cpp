// Tests of our safetensors reader/writer (models/safetensors.h): every corrupt case is rejected
// with its own message (and the messages are distinct), the writer round-trips every dtype
// bit-exactly, and files written by the Python safetensors library (fixtures) read correctly.
// Run: OMP_NUM_THREADS=1 build/tests/test_safetensors
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "models/hf_tensors.h"
#include "models/safetensors.h"

namespace cm = collider::models;
using nlohmann::json;

namespace {

const std::string kFixtures = std::string(COLLIDER_SOURCE_DIR) + "/tests/fixtures/hf";

// 8-byte little-endian length + header + data, with an explicit (possibly lying) length.
std::string raw_file(const std::string& header, const std::string& data, uint64_t header_len) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((header_len >> (8 * i)) & 0xff));
  return out + header + data;
}
std::string raw_file(const std::string& header, const std::string& data) {
  return raw_file(header, data, header.size());
}

cm::SafetensorsFile parse(const std::string& bytes) {
  return cm::SafetensorsFile::from_buffer(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                          "t.safetensors");
}

// The message of the SafetensorsError that `fn` throws ("" when none is thrown).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const cm::SafetensorsError& e) { return e.what(); }
  return "";
}

std::string parse_error(const std::string& bytes) {
  return error_of([&] {
    auto f = parse(bytes);
    f.tensors();
  });
}

std::string valid_file() {
  return cm::serialize_safetensors(
      {{"a", torch::arange(6, torch::kFloat32).view({2, 3})}, {"b", torch::arange(4, torch::kInt64)}});
}

// A Linear(3 -> 2) module: parameters "weight" [2, 3] and "bias" [2].
torch::nn::Linear small_module() { return torch::nn::Linear(3, 2); }

// Each corrupt case: how to produce its error, and the substring that identifies it.
struct CorruptCase {
  const char* name;
  const char* marker;
  std::function<std::string()> error;
};

std::vector<CorruptCase> corrupt_cases() {
  return {
      {"truncated", "is truncated",
       [] {
         std::string f = valid_file();
         return parse_error(f.substr(0, f.size() - 5));
       }},
      {"header_too_long", "header length", [] { return parse_error(raw_file("{}", "", 4096)); }},
      {"bad_json", "not valid JSON", [] { return parse_error(raw_file("{\"a\": [1, 2", "")); }},
      {"offsets_out_of_range", "outside the data region",
       [] {
         return parse_error(
             raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", std::string(8, '\0')));
       }},
      {"overlap", "overlap",
       [] {
         return parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                     std::string(12, '\0')));
       }},
      {"unknown_dtype", "unknown dtype",
       [] {
         return parse_error(
             raw_file(R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')));
       }},
      {"shape_mismatch", "size mismatch",
       [] {
         return parse_error(
             raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')));
       }},
      {"missing_tensor", "missing tensors",
       [] {
         auto m = small_module();
         return error_of([&] { cm::load_parameters(*m, {{"weight", torch::zeros({2, 3})}}, "ckpt"); });
       }},
      {"unexpected_tensor", "unexpected tensors",
       [] {
         auto m = small_module();
         return error_of([&] {
           cm::load_parameters(
               *m, {{"weight", torch::zeros({2, 3})}, {"bias", torch::zeros({2})}, {"extra", torch::zeros({1})}},
               "ckpt");
         });
       }},
  };
}

}  // namespace

// One assertion per corrupt case: rejected, with the file named and its own marker.
class CorruptSafetensors : public ::testing::TestWithParam<size_t> {};

TEST_P(CorruptSafetensors, RejectedWithItsOwnMessage) {
  const auto cases = corrupt_cases();
  const CorruptCase& c = cases[GetParam()];
  const std::string msg = c.error();
  ASSERT_FALSE(msg.empty()) << c.name << ": no error was raised";
  EXPECT_NE(msg.find(c.marker), std::string::npos) << c.name << ": message was: " << msg;
  // Distinct: no other case's marker appears in this message.
  for (const auto& other : cases) {
    if (std::string(other.name) != c.name) {
      EXPECT_EQ(msg.find(other.marker), std::string::npos)
          << c.name << "'s message also matches " << other.name << "'s marker '" << other.marker << "': " << msg;
    }
  }
  // The file cases name the file; the tensor-set cases name the checkpoint.
  const char* source = GetParam() < 7 ? "t.safetensors" : "ckpt";
  EXPECT_NE(msg.find(source), std::string::npos) << "message does not name its source: " << msg;
}

INSTANTIATE_TEST_SUITE_P(AllCases, CorruptSafetensors, ::testing::Range<size_t>(0, 9),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return std::string(corrupt_cases()[info.param].name);
                         });

TEST(Safetensors, MoreCorruptInputsAreRejected) {
  struct Case {
    std::string bytes;
    const char* marker;
  };
  const std::string z8(8, '\0');
  const std::vector<Case> cases = {
      {"", "is truncated"},
      {std::string("\x02\x00\x00", 3), "is truncated"},
      {raw_file("{}", "", uint64_t{1} << 62), "limit"},
      {raw_file("[1,2]", ""), "object at the top level"},
      {raw_file("", ""), "not valid JSON"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", z8), "reversed"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", z8), "invalid shape"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", z8), "invalid shape"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", z8), "invalid data_offsets"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,-8]}})", z8), "invalid data_offsets"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", z8), "lacks one of the fields"},
      {raw_file(R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", z8), "not a string"},
      {raw_file(R"({"a":3})", z8), "is not an object"},
      {raw_file(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
           z8),
       "duplicate tensor name"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", z8), "gap"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", z8), "trailing bytes"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})", z8),
       "overflows"},
      {raw_file(R"({"__metadata__":{"k":1}})", ""), "not a string"},
      {raw_file(R"({"__metadata__":[]})", ""), "__metadata__ must be an object"},
      {raw_file(R"({"a":[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]})", ""), "nested deeper"},
      {raw_file("{\"a\xff\":1}", ""), "not valid JSON"},
  };
  for (const auto& c : cases) {
    const std::string msg = parse_error(c.bytes);
    EXPECT_NE(msg.find(c.marker), std::string::npos) << "expected '" << c.marker << "', got: '" << msg << "'";
  }
}

TEST(Safetensors, BoolBytesOtherThanZeroOrOneAreRejectedOnRead) {
  const std::string f =
      raw_file(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", std::string("\x01\x00\x02", 3));
  const auto file = parse(f);  // the header is fine
  const std::string msg = error_of([&] { file.tensor("m"); });
  EXPECT_NE(msg.find("byte value 2"), std::string::npos) << msg;
}

TEST(Safetensors, UnknownTensorNameIsAnError) {
  const std::string f = valid_file();
  const auto file = parse(f);
  EXPECT_NE(error_of([&] { file.tensor("zzz"); }).find("no tensor named 'zzz'"), std::string::npos);
}

TEST(Safetensors, MissingFileNamesThePath) {
  const std::string msg = error_of([] { cm::SafetensorsFile::open("/nonexistent/dir/x.safetensors"); });
  EXPECT_NE(msg.find("/nonexistent/dir/x.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cannot open"), std::string::npos) << msg;
}

// Bit-exact round trip for every dtype the writer supports, including NaN payloads, -0.0,
// scalars, empty and non-contiguous tensors, and the metadata.
TEST(Safetensors, RoundTripIsBitExactForEveryDtype) {
  torch::manual_seed(0);
  std::map<std::string, torch::Tensor> in;
  const std::vector<torch::ScalarType> dtypes = {
      torch::kFloat64,     torch::kFloat32, torch::kFloat16, torch::kBFloat16, torch::kFloat8_e4m3fn,
      torch::kFloat8_e5m2, torch::kInt64,   torch::kInt32,   torch::kInt16,    torch::kInt8,
      torch::kUInt8,       torch::kBool,    torch::kUInt16,  torch::kUInt32,   torch::kUInt64};
  for (auto dt : dtypes) {
    // Random bytes reinterpreted as the dtype: every bit pattern (NaNs, denormals) must survive.
    const int64_t elem = c10::elementSize(dt);
    torch::Tensor bytes = torch::randint(0, 256, {3 * 5 * elem}, torch::kUInt8);
    torch::Tensor t = dt == torch::kBool ? (bytes.view({15, elem}).select(1, 0) % 2).to(torch::kBool).view({3, 5})
                                         : bytes.view(dt).view({3, 5});
    in[std::string("t_") + c10::toString(dt)] = t;
  }
  in["scalar"] = torch::tensor(-0.0f);
  in["empty"] = torch::zeros({0, 7}, torch::kBFloat16);
  in["transposed"] = torch::randn({4, 6}).t();  // non-contiguous input
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "round trip"}};

  const std::string bytes = cm::serialize_safetensors(in, meta);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ((8 + header_len) % 8, 0u) << "header must be padded so that the data region is 8-byte aligned";

  const auto file = parse(bytes);
  EXPECT_EQ(file.metadata(), meta);
  ASSERT_EQ(file.names().size(), in.size());
  for (const auto& [name, t] : in) {
    torch::Tensor out = file.tensor(name);
    ASSERT_EQ(out.scalar_type(), t.scalar_type()) << name;
    ASSERT_EQ(out.sizes(), t.sizes()) << name;
    torch::Tensor c = t.contiguous();
    // An empty tensor may have no storage: memcmp of null pointers is undefined even for 0 bytes.
    if (c.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(out.data_ptr(), c.data_ptr(), c.nbytes()), 0) << name << " is not bit-exact";
    }
  }
  EXPECT_EQ(cm::serialize_safetensors(file.tensors(), file.metadata()), bytes) << "re-serialising changed the bytes";
}

TEST(Safetensors, FileRoundTripThroughMmap) {
  // (POSIX file calls: libtorch.so exports copies of std::filesystem functions, some broken.)
  const char* tmp = std::getenv("TMPDIR");
  const std::string path = std::string(tmp && *tmp ? tmp : "/tmp") + "/collider_test_roundtrip_" +
                           std::to_string(::getpid()) + ".safetensors";
  std::map<std::string, torch::Tensor> in = {{"w", torch::randn({5, 3}).to(torch::kBFloat16)},
                                             {"i", torch::arange(10, torch::kInt64)}};
  cm::save_safetensors(path, in);
  EXPECT_NE(::access((path + ".tmp." + std::to_string(::getpid())).c_str(), F_OK), 0)
      << "the temporary file was left behind";
  auto out = cm::load_safetensors(path);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(torch::equal(out["w"], in["w"]));
  EXPECT_TRUE(torch::equal(out["i"], in["i"]));
  std::remove(path.c_str());
}

// Files written by the Python safetensors library (scripts/make_hf_fixtures.py).
TEST(Safetensors, ReadsFilesWrittenByTheReferenceLibrary) {
  auto file = cm::SafetensorsFile::open(kFixtures + "/llama/expected.safetensors");
  EXPECT_EQ(file.metadata().at("family"), "llama");
  torch::Tensor ids = file.tensor("input_ids");
  EXPECT_EQ(ids.scalar_type(), torch::kInt64);
  EXPECT_EQ(ids.sizes(), (std::vector<int64_t>{2, 16}));
  // tokens.txt holds the same ids as text.
  std::ifstream tokens(kFixtures + "/llama/tokens.txt");
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 16; ++t) {
      int64_t v = -1;
      tokens >> v;
      EXPECT_EQ(v, ids[b][t].item<int64_t>());
    }
  auto model = cm::SafetensorsFile::open(kFixtures + "/llama/model.safetensors");
  EXPECT_EQ(model.entry("model.embed_tokens.weight").shape, (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(model.entry("model.embed_tokens.weight").dtype, "F32");
}

TEST(Safetensors, LoadParametersConvertsDtypeAndChecksShapes) {
  auto m = small_module();
  torch::Tensor w = torch::randn({2, 3}).to(torch::kBFloat16);
  torch::Tensor b = torch::randn({2}).to(torch::kFloat16);
  cm::load_parameters(*m, {{"weight", w}, {"bias", b}}, "ckpt");
  EXPECT_TRUE(torch::equal(m->weight, w.to(torch::kFloat32)));
  EXPECT_TRUE(torch::equal(m->bias, b.to(torch::kFloat32)));

  const std::string msg = error_of([&] {
    cm::load_parameters(*m, {{"weight", torch::zeros({3, 2})}, {"bias", torch::zeros({2})}}, "ckpt");
  });
  EXPECT_NE(msg.find("'weight' has shape [3, 2] in the checkpoint but [2, 3] in the model"), std::string::npos) << msg;
  const std::string msg2 = error_of([&] {
    cm::load_parameters(*m, {{"weight", torch::zeros({2, 3}, torch::kInt64)}, {"bias", torch::zeros({2})}}, "ckpt");
  });
  EXPECT_NE(msg2.find("floating-point dtype is needed"), std::string::npos) << msg2;
  // Nothing was copied by the failing calls.
  EXPECT_TRUE(torch::equal(m->weight, w.to(torch::kFloat32)));
}
