#include "framework/data.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <vector>

namespace dtrain::framework {
namespace {

TEST(DistributedSampler, RanksPartitionEachEpochDeterministically) {
  const int64_t n = 10;
  std::multiset<int64_t> seen;
  for (int r = 0; r < 3; ++r) {
    DistributedSampler s(n, 3, r, 42);
    EXPECT_EQ(s.indices().size(), 4u);  // ceil(10 / 3), padded by wrapping
    for (int64_t i : s.indices()) seen.insert(i);
    DistributedSampler again(n, 3, r, 42);
    EXPECT_EQ(s.indices(), again.indices()) << "same seed and epoch, same order";
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_GE(seen.count(i), 1u) << i;
  EXPECT_EQ(seen.size(), 12u);
  DistributedSampler a(n, 3, 0, 42), b(n, 3, 0, 42);
  b.set_epoch(1);
  EXPECT_NE(a.indices(), b.indices()) << "a new epoch reshuffles";
  DistributedSampler c(n, 3, 0, 43);
  EXPECT_NE(a.indices(), c.indices()) << "another seed reshuffles";
}

// Without an origin, a rank's k-th sample is its indices()[k % ceil(n / world)] of epoch
// k / ceil(n / world): the order every run before data positions drew.
TEST(DistributedSampler, SampleFollowsTheEpochsIndices) {
  const int64_t n = 23;
  for (int world : {1, 2, 5}) {
    for (int r = 0; r < world; ++r) {
      DistributedSampler s(n, world, r, 9), ref(n, world, r, 9);
      const int64_t per = (n + world - 1) / world;
      for (int64_t k = 0; k < 3 * per + 2; ++k) {
        ref.set_epoch(k / per);
        ASSERT_EQ(s.sample(k), ref.indices()[static_cast<size_t>(k % per)])
            << "world " << world << " rank " << r << " k " << k;
      }
    }
  }
}

// Each rank's samples k0 .. k1 - 1, in order.
std::vector<int64_t> draw(DistributedSampler& s, int64_t k0, int64_t k1) {
  std::vector<int64_t> out;
  for (int64_t k = k0; k < k1; ++k) out.push_back(s.sample(k));
  return out;
}

// A job resized between restarts: 3 ranks draw part of an epoch, the checkpoint keeps where
// the data stands, and 2 (or 5) ranks go on from it. Across the change every sample of the
// epoch is drawn once, apart from the padding that ends any epoch (ranks that wrap to its
// start so that all draw alike, PyTorch's DistributedSampler with drop_last=false).
TEST(DistributedSampler, AResumeAtAnotherWorldSizeDrawsEverySampleOnce) {
  const int64_t n = 29;
  for (int64_t k0 : {0, 1, 4, 9, 10}) {  // 10: the first epoch over (ceil(29 / 3) = 10)
    for (int now : {1, 2, 3, 5}) {
      std::multiset<int64_t> seen;
      std::vector<DataPosition> at;
      for (int r = 0; r < 3; ++r) {
        DistributedSampler s(n, 3, r, 5);
        for (int64_t id : draw(s, 0, k0)) seen.insert(id);
        at.push_back(s.position(k0));
      }
      for (const DataPosition& p : at) {
        EXPECT_EQ(p.epoch, at[0].epoch);
        EXPECT_EQ(p.position, at[0].position) << "every rank stands at the same place";
      }
      const int64_t k1 = 100;  // the resumed run's own step count: its index goes on
      const int64_t epoch0 = at[0].epoch;
      const int64_t rest = (n - at[0].position + now - 1) / now;  // each new rank's share
      std::multiset<int64_t> epoch_seen = epoch0 == 0 ? seen : std::multiset<int64_t>{};
      for (int r = 0; r < now; ++r) {
        DistributedSampler s(n, now, r, 5);
        s.set_origin(k1, at[0]);
        for (int64_t id : draw(s, k1, k1 + rest)) epoch_seen.insert(id);
        EXPECT_EQ(s.position(k1 + rest).epoch, epoch0 + 1) << "the epoch ends there";
        EXPECT_EQ(s.position(k1 + rest).position, 0);
        // The next epoch is a whole one at this world size: as a run that started at it.
        DistributedSampler fresh(n, now, r, 5);
        const int64_t per = (n + now - 1) / now;
        EXPECT_EQ(draw(s, k1 + rest, k1 + rest + per),
                  draw(fresh, per * (epoch0 + 1), per * (epoch0 + 2)));
      }
      const int64_t padding = rest * now - (n - at[0].position);
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_GE(epoch_seen.count(i), 1u)
            << "sample " << i << " never drawn (k0 " << k0 << ", " << now << " ranks)";
      }
      EXPECT_EQ(static_cast<int64_t>(epoch_seen.size()), n + padding)
          << "k0 " << k0 << ", " << now << " ranks: only the epoch's padding repeats";
    }
  }
}

// Resumed at the same world size, the origin changes nothing: the same samples as a run
// that never stopped, across epochs.
TEST(DistributedSampler, AResumeAtTheSameWorldSizeDrawsWhatAnUnbrokenRunDraws) {
  const int64_t n = 17;
  for (int64_t k0 : {0, 3, 6, 7}) {
    for (int r = 0; r < 3; ++r) {
      DistributedSampler unbroken(n, 3, r, 11), resumed(n, 3, r, 11);
      resumed.set_origin(k0, unbroken.position(k0));
      EXPECT_EQ(draw(resumed, k0, k0 + 40), draw(unbroken, k0, k0 + 40)) << k0 << " " << r;
    }
  }
}

TEST(ByteCorpus, WindowsAreShiftedByOneAndComeFromTheFile) {
  ByteCorpusSource src("/usr/share/common-licenses/GPL-3", 16, 4, 1, 2, 1, 7);
  Batch b = src.next(0, 0);
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_TRUE(at::equal(b.inputs.narrow(1, 1, 15), b.targets.narrow(1, 0, 15)));
  EXPECT_LT(b.inputs.max().item<int64_t>(), 256);
}

// A resumed run continues with nothing but the step: every batch is a function of
// (step, micro), also across epoch boundaries, whatever came before.
TEST(ByteCorpus, BatchesDependOnTheStepAloneSoAResumeNeedsNoDataState) {
  const char* path = "/usr/share/common-licenses/GPL-3";
  ByteCorpusSource walked(path, 64, 8, 2, 2, 0, 7), fresh(path, 64, 8, 2, 2, 0, 7);
  // ~35k bytes / 64 = ~550 windows, ~270 per rank: step 20 (micro 2 x 8) is in epoch 1.
  for (int64_t step = 0; step < 20; ++step) {
    for (int64_t m = 0; m < 2; ++m) walked.next(step, m);
  }
  for (int64_t m = 0; m < 2; ++m) {
    EXPECT_TRUE(at::equal(walked.next(20, m).inputs, fresh.next(20, m).inputs)) << "micro " << m;
  }
  EXPECT_FALSE(at::equal(fresh.next(20, 0).inputs, fresh.next(3, 0).inputs));
}

// The validation set is the same at any world size, held out of training.
TEST(Validation, SharesCoverTheSameSetAtAnyWorldSize) {
  const char* path = "/usr/share/common-licenses/GPL-3";
  auto all_rows = [&](int world) {
    std::vector<at::Tensor> rows;
    for (int r = 0; r < world; ++r) {
      ByteCorpusSource src(path, 32, 4, 1, world, r, 7);
      rows.push_back(src.validation(r, world).inputs);
    }
    at::Tensor t = at::cat(rows);
    return std::get<0>(at::sort(t.select(1, 0) * 1000003 + t.select(1, 1)));
  };
  EXPECT_EQ(all_rows(1).size(0), 12);
  EXPECT_TRUE(at::equal(all_rows(1), all_rows(2)));
  EXPECT_TRUE(at::equal(all_rows(1), all_rows(3)));
  SyntheticLMSource lm(50, 8, 2, 0, 1);
  EXPECT_TRUE(at::equal(at::cat({lm.validation(0, 2).inputs, lm.validation(1, 2).inputs}).sum(),
                        lm.validation(0, 1).inputs.sum()));
}

// ---- token files -------------------------------------------------------------------------

std::string scratch(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base ? base : "/tmp") + "/" + name;
}

template <typename T>
void write_bin(const std::string& path, const std::vector<T>& tokens) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(T));
}

// An .npy file as numpy.save writes one (format 1.0, header padded to 64 bytes).
template <typename T>
void write_npy(const std::string& path, const std::vector<T>& tokens, const std::string& descr,
               const std::string& shape = "") {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" +
                     (shape.empty() ? std::to_string(tokens.size()) + "," : shape) + "), }";
  while ((10 + dict.size() + 1) % 64 != 0) dict += ' ';
  dict += '\n';
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(dict.size());
  f.write(reinterpret_cast<const char*>(&len), 2);
  f << dict;
  f.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(T));
}

template <typename T>
std::vector<T> ramp(size_t n, int64_t offset, int64_t vocab) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<T>((static_cast<int64_t>(i) + offset) % vocab);
  return v;
}

// What a window holds: the file's tokens from `start`, shifted by one for the targets.
void expect_window(const Batch& b, int64_t row, int64_t first_token, int64_t vocab,
                   int64_t seq_len) {
  for (int64_t t = 0; t < seq_len; ++t) {
    ASSERT_EQ(b.inputs[row][t].item<int64_t>(), (first_token + t) % vocab) << "row " << row;
    ASSERT_EQ(b.targets[row][t].item<int64_t>(), (first_token + t + 1) % vocab) << "row " << row;
  }
}

TEST(TokenFiles, BinAndNpyFilesByGlobGiveTheirWindowsNeverSpanningTwoFiles) {
  const std::string dir = scratch("tokens_glob");
  std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
  const int64_t vocab = 1000, seq = 16;
  // File a: 100 uint16 tokens (6 windows), b: 50 int32 tokens in an .npy (3 windows).
  write_bin(dir + "/a.bin", ramp<uint16_t>(100, 0, vocab));
  write_npy(dir + "/b.npy", ramp<int32_t>(50, 500, vocab), "<i4");
  TokenFileSource src(dir + "/*", "uint16", "", vocab, seq, 4, 1, 1, 0, 7, /*eval_samples=*/2);
  EXPECT_EQ(src.num_samples(), 9 - 2);  // the last 2 windows are held out
  EXPECT_NE(src.describe().find("2 file(s), 150 tokens"), std::string::npos) << src.describe();
  // Every training window, over enough steps, is one of a's or b's, read right.
  std::set<int64_t> firsts;
  for (int64_t step = 0; step < 4; ++step) {
    Batch b = src.next(step, 0);
    ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{4, seq}));
    for (int64_t r = 0; r < 4; ++r) {
      const int64_t first = b.inputs[r][0].item<int64_t>();
      firsts.insert(first);
      expect_window(b, r, first, vocab, seq);
      const bool in_a = first < 100 && first % seq == 0 && first / seq < 6;
      const bool in_b = first >= 500 && (first - 500) % seq == 0 && (first - 500) / seq < 1;
      EXPECT_TRUE(in_a || in_b) << "window starting at token " << first;
    }
  }
  EXPECT_EQ(firsts.size(), 7u) << "every training window is drawn in an epoch";
  // Validation: b's last two windows (tokens 16 and 32 of b), never trained on.
  Batch v = src.validation(0, 1);
  ASSERT_EQ(v.inputs.size(0), 2);
  expect_window(v, 0, 516, vocab, seq);
  expect_window(v, 1, 532, vocab, seq);
}

TEST(TokenFiles, BatchesDependOnTheStepAloneAndValPathServesValidation) {
  const std::string dir = scratch("tokens_val");
  std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
  write_bin(dir + "/train.bin", ramp<uint32_t>(4000, 0, 70000));
  write_npy(dir + "/val.npy", ramp<uint32_t>(200, 60000, 70000), "<u4");
  auto make = [&](int rank) {
    return std::make_unique<TokenFileSource>(dir + "/train.bin", "uint32", dir + "/val.npy", 70000,
                                             32, 4, 2, 2, rank, 5, 4);
  };
  auto a = make(0), b = make(0), other = make(1);
  EXPECT_EQ(a->num_samples(), 124);  // nothing held out: val_path holds the validation windows
  for (int64_t step : {0, 3, 40}) {  // 40 steps x 2 micro x 4 > one epoch (62 per rank)
    EXPECT_TRUE(at::equal(a->next(step, 1).inputs, b->next(step, 1).inputs));
    EXPECT_FALSE(at::equal(a->next(step, 1).inputs, other->next(step, 1).inputs));
  }
  // val.npy holds 6 windows: the 4 validated are spread over them (windows 0, 1, 3, 4).
  Batch v = a->validation(0, 1);
  ASSERT_EQ(v.inputs.size(0), 4);
  const int64_t spread[] = {0, 1, 3, 4};
  for (int64_t r = 0; r < 4; ++r) expect_window(v, r, 60000 + 32 * spread[r], 70000, 32);
}

// data.val_fraction: the training files' last tenth is the validation split, never trained
// on, and the validation set is spread over it.
TEST(TokenFiles, AValidationFractionHoldsOutTheLastWindowsAndSpreadsTheSetOverThem) {
  const std::string dir = scratch("tokens_fraction");
  std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
  const int64_t vocab = 4000, seq = 32;
  write_bin(dir + "/train.bin", ramp<uint16_t>(100 * seq + 1, 0, vocab));  // 100 windows
  TokenFileSource src(dir + "/train.bin", "uint16", "", vocab, seq, 4, 1, 1, 0, 3,
                      /*eval_samples=*/4, /*val_fraction=*/0.1);
  EXPECT_EQ(src.num_samples(), 90);
  for (int64_t step = 0; step < 23; ++step) {  // an epoch and more
    Batch b = src.next(step, 0);
    for (int64_t r = 0; r < 4; ++r) {
      EXPECT_LT(b.inputs[r][0].item<int64_t>() / seq, 90) << "a validation window was trained on";
    }
  }
  Batch v = src.validation(0, 1);
  ASSERT_EQ(v.inputs.size(0), 4);
  const int64_t spread[] = {90, 92, 95, 97};
  for (int64_t r = 0; r < 4; ++r) expect_window(v, r, seq * spread[r], vocab, seq);
  // At least eval_samples windows are held out whatever the fraction.
  TokenFileSource few(dir + "/train.bin", "uint16", "", vocab, seq, 4, 1, 1, 0, 3, 12, 0.01);
  EXPECT_EQ(few.num_samples(), 88);
}

std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

TEST(TokenFiles, BadFilesAreRefusedNamingTheFile) {
  const std::string dir = scratch("tokens_bad");
  std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
  auto open = [&](const std::string& name, const std::string& dtype = "uint16",
                  int64_t vocab = 1000) {
    return config_error(
        [&] { TokenFileSource(dir + "/" + name, dtype, "", vocab, 16, 2, 1, 1, 0, 1, 2); });
  };
  // A .bin file cut in the middle of a token.
  write_bin(dir + "/odd.bin", std::vector<uint8_t>(301, 1));
  EXPECT_NE(open("odd.bin").find("'" + dir +
                                 "/odd.bin' has 301 bytes, not a whole number of "
                                 "uint16 tokens"),
            std::string::npos)
      << open("odd.bin");
  // An .npy whose data ends before its header's count.
  write_npy(dir + "/short.npy", ramp<uint16_t>(100, 0, 1000), "<u2", "500,");
  EXPECT_NE(open("short.npy").find("is truncated: its header says 500 tokens, it holds 100"),
            std::string::npos)
      << open("short.npy");
  write_npy(dir + "/float.npy", std::vector<float>(100, 1.0f), "<f4");
  EXPECT_NE(open("float.npy").find("holds dtype '<f4'"), std::string::npos) << open("float.npy");
  write_npy(dir + "/matrix.npy", ramp<uint16_t>(100, 0, 1000), "<u2", "10, 10");
  EXPECT_NE(open("matrix.npy").find("a token file is one flat array"), std::string::npos)
      << open("matrix.npy");
  // Fewer tokens than the windows it needs.
  write_bin(dir + "/tiny.bin", ramp<uint16_t>(40, 0, 1000));
  EXPECT_NE(open("tiny.bin")
                .find("holds 40 tokens in 2 window(s) of model.seq_len + 1 = 17 "
                      "tokens, too few to hold out 2"),
            std::string::npos)
      << open("tiny.bin");
  EXPECT_NE(open("nothing*.bin").find("matches no file"), std::string::npos);
  // A tokenizer's vocabulary larger than the model's (or another dtype than data.dtype): an
  // id outside the vocabulary, named with its file and place, when its window is read.
  write_bin(dir + "/wide.bin", std::vector<uint16_t>(400, 999));
  TokenFileSource wrong(dir + "/wide.bin", "uint16", "", 999, 16, 8, 1, 1, 0, 1, 2);
  const std::string e = config_error([&] {
    for (int64_t step = 0; step < 8; ++step) wrong.next(step, 0);
  });
  EXPECT_NE(e.find("'" + dir + "/wide.bin' holds token id 999 at token"), std::string::npos) << e;
  EXPECT_NE(e.find("outside model.vocab_size 999"), std::string::npos) << e;
}

// The data path is never the bottleneck, and a file far larger than what is read is never
// read whole: a 4 GiB file (sparse, so it costs no disk) opens at once, and sampling it
// grows the resident file pages (RssFile: the mapping's, apart from the heap, which a
// sanitizer's quarantine inflates) by the pages read, not by the file.
long status_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field, 0) == 0) return std::atol(line.c_str() + std::strlen(field));
  }
  return -1;
}

TEST(TokenFiles, AFourGiBFileOpensAtOnceAndSamplingItKeepsTheMemoryFlat) {
  const std::string path = scratch("tokens_big.bin");
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(::ftruncate(fileno(f), int64_t{4} << 30), 0);
    std::fclose(f);
  }
  const long before = status_kib("VmRSS:"), file_before = status_kib("RssFile:");
  const auto t0 = std::chrono::steady_clock::now();
  TokenFileSource src(path, "uint16", "", 50304, 1024, 8, 1, 2, 0, 1);
  const double open_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto t1 = std::chrono::steady_clock::now();
  const int batches = 200;
  for (int step = 0; step < batches; ++step) src.next(step, 0);
  const double per_s =
      batches / std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const long grown = status_kib("VmRSS:") - before;
  const long file_grown = status_kib("RssFile:") - file_before;
  std::printf(
      "4 GiB token file: opened in %.3f s, %.0f batches/s (8 x 1024 tokens), RSS grew "
      "%ld KiB, of which file pages %ld KiB\n",
      open_s, per_s, grown, file_grown);
  EXPECT_EQ(src.num_samples(), ((int64_t{2} << 30) - 1) / 1024 - 12);
  ASSERT_GE(file_before, 0) << "no RssFile in /proc/self/status";
  EXPECT_LT(file_grown, 64 * 1024) << "sampling read the file, not its windows";
  std::remove(path.c_str());
}

TEST(SyntheticSources, AreReproducibleAndRankSpecific) {
  SyntheticLMSource a(50, 8, 2, 0, 1), b(50, 8, 2, 0, 1), c(50, 8, 2, 1, 1);
  EXPECT_TRUE(at::equal(a.next(3, 1).inputs, b.next(3, 1).inputs));
  EXPECT_FALSE(at::equal(a.next(3, 1).inputs, c.next(3, 1).inputs));
  SyntheticClassificationSource s(6, 3, 5, 0, 1);
  Batch x = s.next(0, 0);
  EXPECT_EQ(x.targets.max().item<int64_t>() < 3, true);
}

}  // namespace
}  // namespace dtrain::framework
