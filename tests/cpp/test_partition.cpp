// partition() against a brute force over all contiguous splits, plus errors and a large case.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/partition.hpp"

using gpipe_fast::InvalidArgument;

namespace {

struct Score {
  double max_cell = 0.0;
  double sum_squares = 0.0;
};

Score score(const std::vector<double>& costs, const std::vector<int>& counts) {
  Score out;
  std::size_t at = 0;
  for (int count : counts) {
    double cell = 0.0;
    for (int i = 0; i < count; ++i) cell += costs[at++];
    out.max_cell = std::max(out.max_cell, cell);
    out.sum_squares += cell * cell;
  }
  return out;
}

// Every split of costs into `cells` contiguous non-empty cells: the smallest largest-cell
// cost, and the smallest sum of squares among the splits that reach it.
Score brute_force(const std::vector<double>& costs, int cells) {
  const int n = static_cast<int>(costs.size());
  Score best{std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  // A split is a choice of cells-1 cut positions among the n-1 gaps: a bitmask over gaps.
  for (std::uint32_t mask = 0; mask < (1u << (n - 1)); ++mask) {
    std::vector<int> counts;
    int run = 1;
    for (int gap = 0; gap < n - 1; ++gap) {
      if (mask & (1u << gap)) {
        counts.push_back(run);
        run = 1;
      } else {
        ++run;
      }
    }
    counts.push_back(run);
    if (static_cast<int>(counts.size()) != cells) continue;
    const Score s = score(costs, counts);
    if (s.max_cell < best.max_cell) {
      best = s;
    } else if (s.max_cell == best.max_cell) {
      best.sum_squares = std::min(best.sum_squares, s.sum_squares);
    }
  }
  return best;
}

bool well_formed(const std::vector<int>& counts, int n, int cells) {
  if (static_cast<int>(counts.size()) != cells) return false;
  for (int c : counts) {
    if (c < 1) return false;
  }
  return std::accumulate(counts.begin(), counts.end(), 0) == n;
}

std::string show(const std::vector<double>& costs, int cells) {
  std::string out = "cells=" + std::to_string(cells) + " costs=[";
  for (std::size_t i = 0; i < costs.size(); ++i) {
    out += (i ? "," : "") + std::to_string(static_cast<long long>(costs[i]));
  }
  return out + "]";
}

// Fewest cells (each within `limit`) a greedy left-to-right packing needs; optimal for
// contiguous packing. Returns a huge number when one layer alone exceeds the limit.
int greedy_cells(const std::vector<double>& costs, double limit) {
  int cells = 1;
  double current = 0.0;
  for (double c : costs) {
    if (c > limit) return std::numeric_limits<int>::max();
    if (current + c > limit) {
      ++cells;
      current = c;
    } else {
      current += c;
    }
  }
  return cells;
}

}  // namespace

TEST(partition_matches_brute_force_on_random_integer_costs) {
  std::mt19937 rng(20240611u);
  int cases = 0;
  for (int round = 0; round < 400; ++round) {
    const int n = std::uniform_int_distribution<int>(1, 9)(rng);
    const int cells = std::uniform_int_distribution<int>(1, n)(rng);
    // Small integer range (zeros included) so that ties between splits are common.
    const int top = round % 3 == 0 ? 2 : 6;
    std::vector<double> costs(static_cast<std::size_t>(n));
    for (auto& c : costs) c = std::uniform_int_distribution<int>(0, top)(rng);

    const std::vector<int> counts = gpipe_fast::partition(costs, cells);
    const bool ok = well_formed(counts, n, cells);
    CHECK(ok);
    if (!ok) continue;
    const Score got = score(costs, counts);
    const Score want = brute_force(costs, cells);
    if (got.max_cell != want.max_cell || got.sum_squares != want.sum_squares) {
      check::fail(__FILE__, __LINE__,
                  "partition " + show(costs, cells) + ": max " + std::to_string(got.max_cell) +
                      " sumsq " + std::to_string(got.sum_squares) + ", brute force max " +
                      std::to_string(want.max_cell) + " sumsq " + std::to_string(want.sum_squares));
    }
    ++cases;
  }
  CHECK_EQ(cases, 400);
}

TEST(partition_matches_brute_force_bottleneck_on_real_costs) {
  std::mt19937 rng(7u);
  for (int round = 0; round < 200; ++round) {
    const int n = std::uniform_int_distribution<int>(1, 9)(rng);
    const int cells = std::uniform_int_distribution<int>(1, n)(rng);
    std::vector<double> costs(static_cast<std::size_t>(n));
    for (auto& c : costs) c = std::uniform_real_distribution<double>(0.0, 10.0)(rng);
    const std::vector<int> counts = gpipe_fast::partition(costs, cells);
    CHECK(well_formed(counts, n, cells));
    if (!well_formed(counts, n, cells)) continue;
    const double got = score(costs, counts).max_cell;
    const double want = brute_force(costs, cells).max_cell;
    CHECK(std::fabs(got - want) <= 1e-9 * std::max(1.0, want));
  }
}

TEST(partition_exact_on_tiny_and_huge_costs) {
  // Costs that are exact in binary (small integers times 2^-50, or 2^48 plus a small integer)
  // so every sum is exact: any tolerance in partition() larger than the costs' steps would
  // accept a split with a worse bottleneck than the brute force's.
  std::mt19937 rng(31337u);
  const double tiny = std::ldexp(1.0, -50);
  const double huge = std::ldexp(1.0, 48);
  for (int round = 0; round < 300; ++round) {
    const int n = std::uniform_int_distribution<int>(2, 9)(rng);
    const int cells = std::uniform_int_distribution<int>(2, n)(rng);
    std::vector<int> units(static_cast<std::size_t>(n));
    for (auto& u : units) u = std::uniform_int_distribution<int>(0, 6)(rng);
    std::vector<double> small(units.begin(), units.end());
    std::vector<double> large(units.begin(), units.end());
    for (auto& c : small) c *= tiny;
    for (auto& c : large) c += huge;

    const std::vector<int> small_counts = gpipe_fast::partition(small, cells);
    const std::vector<int> large_counts = gpipe_fast::partition(large, cells);
    CHECK(well_formed(small_counts, n, cells));
    CHECK(well_formed(large_counts, n, cells));
    if (!well_formed(small_counts, n, cells) || !well_formed(large_counts, n, cells)) continue;
    const Score small_got = score(small, small_counts);
    const Score small_want = brute_force(small, cells);
    if (small_got.max_cell != small_want.max_cell ||
        small_got.sum_squares != small_want.sum_squares) {
      std::vector<double> as_units(units.begin(), units.end());
      check::fail(__FILE__, __LINE__, "tiny costs (units of 2^-50) " + show(as_units, cells));
    }
    if (score(large, large_counts).max_cell != brute_force(large, cells).max_cell) {
      std::vector<double> as_units(units.begin(), units.end());
      check::fail(__FILE__, __LINE__, "huge costs (2^48 + units) " + show(as_units, cells));
    }
  }
}

TEST(partition_hand_written_cases) {
  CHECK(gpipe_fast::partition({1, 1, 1, 1}, 2) == (std::vector<int>{2, 2}));
  CHECK(gpipe_fast::partition({1, 1, 1, 1}, 4) == (std::vector<int>{1, 1, 1, 1}));
  CHECK(gpipe_fast::partition({1, 2, 3}, 1) == (std::vector<int>{3}));
  CHECK(gpipe_fast::partition({5, 1, 1, 1, 1, 1}, 2) == (std::vector<int>{1, 5}));
  CHECK(gpipe_fast::partition({0, 0, 0}, 3) == (std::vector<int>{1, 1, 1}));
  // Bottleneck 4 is forced by the last layer; balance then prefers 3+3 over 2+4 / 4+2.
  CHECK(gpipe_fast::partition({1, 2, 1, 2, 4}, 3) == (std::vector<int>{2, 2, 1}));
}

TEST(partition_rejects_bad_arguments) {
  CHECK_THROWS(gpipe_fast::partition({}, 1), InvalidArgument);
  CHECK_THROWS(gpipe_fast::partition({1, 2}, 0), InvalidArgument);
  CHECK_THROWS(gpipe_fast::partition({1, 2}, -1), InvalidArgument);
  CHECK_THROWS(gpipe_fast::partition({1, 2}, 3), InvalidArgument);
  CHECK_THROWS(gpipe_fast::partition({1, -1, 2}, 2), InvalidArgument);
  CHECK_THROWS(gpipe_fast::partition({1, std::numeric_limits<double>::quiet_NaN(), 2}, 2),
               InvalidArgument);
  CHECK_THROWS(gpipe_fast::partition({1, std::numeric_limits<double>::infinity()}, 1),
               InvalidArgument);
}

TEST(partition_large_case_completes) {
  std::mt19937 rng(99u);
  std::vector<double> costs(5000);
  for (auto& c : costs) c = std::uniform_int_distribution<int>(0, 100)(rng);
  const int cells = 200;
  const std::vector<int> counts = gpipe_fast::partition(costs, cells);
  CHECK(well_formed(counts, 5000, cells));
  if (!well_formed(counts, 5000, cells)) return;
  // Optimality without a brute force: integer costs give an integer bottleneck B; the
  // greedy packing fits 200 cells at B but not at B - 1.
  const double bottleneck = score(costs, counts).max_cell;
  CHECK_EQ(bottleneck, std::round(bottleneck));
  CHECK(greedy_cells(costs, bottleneck) <= cells);
  CHECK(greedy_cells(costs, bottleneck - 1.0) > cells);
}
