// Tests of the order statistics every timing row and benchmark reports (measuring/stats.h): quantiles
// by linear interpolation (numpy's default), the median, and the relative IQR; and the h:mm:ss
// durations of progress lines (base/duration.h); the measurement engine's interleaved rounds and
// per-round medians (measuring/rounds.h); a group's figures against its references
// (measuring/figures.h).
#include "base/duration.h"
#include "measuring/figures.h"
#include "measuring/stats.h"
#include "measuring/rounds.h"

#include <cmath>
#include <string>

#include <gtest/gtest.h>

namespace cs = collider::stats;

TEST(Stats, QuantilesInterpolateBetweenClosestRanks) {
  const std::vector<double> v = {4, 1, 3, 2, 5};  // sorted 1..5
  EXPECT_DOUBLE_EQ(cs::quantile(v, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(cs::quantile(v, 0.25), 2.0);
  EXPECT_DOUBLE_EQ(cs::quantile(v, 0.5), 3.0);
  EXPECT_DOUBLE_EQ(cs::quantile(v, 0.75), 4.0);
  EXPECT_DOUBLE_EQ(cs::quantile(v, 1.0), 5.0);
  EXPECT_DOUBLE_EQ(cs::quantile({1, 2}, 0.25), 1.25);  // numpy.quantile([1, 2], 0.25)
}

TEST(Stats, MedianOfEvenCountIsTheMidpoint) {
  EXPECT_DOUBLE_EQ(cs::median({1, 2, 3, 10}), 2.5);
  EXPECT_DOUBLE_EQ(cs::median({7}), 7.0);
  EXPECT_DOUBLE_EQ(cs::median({}), 0.0);
}

TEST(Stats, RelativeIqrIsTheQuartileDistanceOverTheMedian) {
  EXPECT_DOUBLE_EQ(cs::rel_iqr({1, 2, 3, 4, 5}), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(cs::rel_iqr({5, 5, 5}), 0.0);
  EXPECT_DOUBLE_EQ(cs::rel_iqr({}), 0.0);
  EXPECT_DOUBLE_EQ(cs::rel_iqr({0, 0, 0}), 0.0);  // no centre, no relative spread
}

TEST(Stats, SerpentineRunsOddRoundsInReverse) {
  std::vector<size_t> order;
  for (long long round = 0; round < 3; ++round)
    for (size_t j = 0; j < 3; ++j) order.push_back(cs::serpentine(round, j, 3));
  EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2, 2, 1, 0, 0, 1, 2}));
}

TEST(Rounds, WarmUpsInOrderThenSerpentineRoundsSkippingFailedVariants) {
  std::string order;
  collider::stats::Interleaving how;
  how.warm_up = [&](size_t j) { order += "w" + std::to_string(j) + " "; };
  how.measure = [&](size_t j, int64_t round) { order += std::to_string(round) + ":" + std::to_string(j) + " "; };
  how.standing = [&](size_t j) { return !(j == 1 && order.size() > 20); };  // variant 1 fails after round 0
  how.after_round = [&](int64_t round) { order += "| "; };
  collider::stats::interleave(3, 3, how);
  EXPECT_EQ(order, "w0 w1 w2 0:0 0:1 0:2 | 1:2 1:0 | 2:0 2:2 | ");
  std::string stopped;
  how.warm_up = nullptr;
  how.standing = nullptr;
  how.after_round = nullptr;
  how.measure = [&](size_t j, int64_t round) { stopped += std::to_string(round) + ":" + std::to_string(j) + " "; };
  how.stop = [&] { return stopped.size() >= 8; };  // after two blocks
  collider::stats::interleave(3, 3, how);
  EXPECT_EQ(stopped, "0:0 0:1 ");
}

TEST(Rounds, SeriesKeepsEveryRoundsMedian) {
  collider::stats::Series s;
  for (double v : {3.0, 1.0, 2.0}) s.add(v);
  s.end_round();
  for (double v : {10.0, 20.0}) s.add(v);
  s.end_round();
  EXPECT_EQ(s.round_medians(), (std::vector<double>{2.0, 15.0}));
  EXPECT_DOUBLE_EQ(s.last_round_median(), 15.0);
  EXPECT_DOUBLE_EQ(s.median(), 3.0);
  EXPECT_EQ(s.samples().size(), 5u);
  EXPECT_DOUBLE_EQ(s.rel_iqr(), cs::rel_iqr({3, 1, 2, 10, 20}));
}

// One group: regular 100 ms (step 200), its A/A copy, collider at T' 16 (backward + rewrite 70 ms,
// FLOP ideal 0.4), loss_only with no ideal and no floor, the floor at T' 16 (56 ms), and a
// collider row whose T' has no floor.
TEST(Figures, EachRowAgainstTheGroupsRegularIdealAndFloor) {
  using Role = cs::GroupRow::Role;
  auto row = [](Role role, double cost, double step, double ideal, int64_t t) {
    cs::GroupRow r;
    r.role = role;
    r.cost_ms = cost;
    r.step_ms = step;
    r.flop_ideal = ideal;
    r.t_prime = t;
    return r;
  };
  const auto f = cs::group_figures({row(Role::kBaseline, 100, 200, NAN, -1), row(Role::kCopy, 98, 202, NAN, -1),
                                    row(Role::kMethod, 70, 160, 0.4, 16), row(Role::kMethod, 99, 199, NAN, -1),
                                    row(Role::kFloor, 56, 150, NAN, 16), row(Role::kMethod, 80, 170, 0.3, 24)});
  ASSERT_EQ(f.size(), 6u);
  EXPECT_DOUBLE_EQ(f[0].reduction, 0.0);
  EXPECT_DOUBLE_EQ(f[0].step_reduction, 0.0);
  EXPECT_TRUE(std::isnan(f[0].of_ideal) && std::isnan(f[0].vs_floor));
  EXPECT_NEAR(f[1].reduction, 0.02, 1e-12);  // the A/A copy's: the noise
  EXPECT_NEAR(f[2].reduction, 0.30, 1e-12);
  EXPECT_NEAR(f[2].step_reduction, 0.20, 1e-12);
  EXPECT_NEAR(f[2].of_ideal, 0.75, 1e-12);
  EXPECT_NEAR(f[2].vs_floor, 1.25, 1e-12);
  EXPECT_NEAR(f[3].reduction, 0.01, 1e-12);
  EXPECT_TRUE(std::isnan(f[3].of_ideal) && std::isnan(f[3].vs_floor));
  EXPECT_NEAR(f[4].reduction, 0.44, 1e-12);  // the floor against regular
  EXPECT_TRUE(std::isnan(f[4].vs_floor));
  EXPECT_TRUE(std::isnan(f[5].vs_floor)) << "no floor measured at T' 24";
  // With no regular row there is no reduction, and so no share of the ideal.
  const auto alone = cs::group_figures({row(Role::kMethod, 70, 160, 0.4, 16), row(Role::kFloor, 56, 150, NAN, 16)});
  EXPECT_TRUE(std::isnan(alone[0].reduction) && std::isnan(alone[0].of_ideal));
  EXPECT_NEAR(alone[0].vs_floor, 1.25, 1e-12);
}

TEST(Duration, ProgressLinesPrintHoursMinutesSeconds) {
  EXPECT_EQ(collider::hms(0.0), "0:00:00");
  EXPECT_EQ(collider::hms(59.6), "0:01:00");  // rounded to the nearest second
  EXPECT_EQ(collider::hms(3725.0), "1:02:05");
  EXPECT_EQ(collider::hms(93787.0), "26:03:07");  // hours not wrapped
}
