// Min-max contiguous partition (exact DP with binary-searched splits), ties to balance.
#include "gpipe_fast/partition.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The smallest achievable largest-cell cost. best[i] holds the optimum for the first i
// layers in the current number of cells; it is non-decreasing in i and the cost of the
// last cell (prefix[i] - prefix[s]) is non-increasing in s, so the best split point is
// where the two cross and a binary search finds it: O(cells * n * log n).
double min_bottleneck(const std::vector<double>& prefix, int cells) {
  const int n = static_cast<int>(prefix.size()) - 1;
  std::vector<double> best(static_cast<std::size_t>(n + 1), kInf), next(best.size());
  for (int i = 1; i <= n; ++i) best[static_cast<std::size_t>(i)] = prefix[static_cast<std::size_t>(i)];
  for (int j = 2; j <= cells; ++j) {
    std::fill(next.begin(), next.end(), kInf);
    for (int i = j; i <= n; ++i) {
      auto cost = [&](int s) {
        return std::max(best[static_cast<std::size_t>(s)],
                        prefix[static_cast<std::size_t>(i)] - prefix[static_cast<std::size_t>(s)]);
      };
      // s ranges over [j-1, i-1]; find the first s where best[s] >= last-cell cost.
      int lo = j - 1, hi = i - 1;
      while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        if (best[static_cast<std::size_t>(mid)] >=
            prefix[static_cast<std::size_t>(i)] - prefix[static_cast<std::size_t>(mid)])
          hi = mid;
        else
          lo = mid + 1;
      }
      double value = cost(lo);
      if (lo > j - 1) value = std::min(value, cost(lo - 1));
      next[static_cast<std::size_t>(i)] = value;
    }
    std::swap(best, next);
  }
  return best[static_cast<std::size_t>(n)];
}

// One row of the balancing DP: for each prefix length i, the split s (last cell = layers
// s..i-1) minimising score[s] + cost(s, i)^2 over the feasible window
// [max(window_start[i], first), min(i - 1, reach)]. The squared cost obeys the quadrangle
// inequality and both window ends are non-decreasing in i, so the smallest optimal s is
// non-decreasing in i too: divide and conquer finds a row in O(n log n) instead of
// O(n * window), which matters when many layers cost ~0 and windows span the whole model.
struct ChooseSplits {
  const std::vector<double>& prefix;
  const std::vector<double>& score;
  const std::vector<int>& window_start;
  std::vector<double>& best;
  int* choice;
  int first;  // smallest feasible split (j - 1 cells before it)
  int reach;  // largest feasible split

  // Fills best/choice for i in [ilo, ihi], knowing their splits lie in [slo, shi].
  void solve(int ilo, int ihi, int slo, int shi) {
    if (ilo > ihi) return;
    const int mid = ilo + (ihi - ilo) / 2;
    const int from = std::max(window_start[static_cast<std::size_t>(mid)], first);
    const int to = std::min(mid - 1, reach);
    int arg = scan(mid, std::max(from, slo), std::min(to, shi));
    if (arg < 0) arg = scan(mid, from, to);  // guard: never trust the bound over the window
    if (arg < 0) {
      // Not even the full window is feasible: mid lies past what these cells can hold, and
      // so does every longer prefix.
      solve(ilo, mid - 1, slo, shi);
      return;
    }
    solve(ilo, mid - 1, slo, arg);
    solve(mid + 1, ihi, arg, shi);
  }

  // The smallest best split of prefix i within [from, to], or -1 if none is feasible.
  int scan(int i, int from, int to) {
    int arg = -1;
    double value = kInf;
    for (int s = from; s <= to; ++s) {
      if (score[static_cast<std::size_t>(s)] == kInf) continue;
      const double cell = prefix[static_cast<std::size_t>(i)] - prefix[static_cast<std::size_t>(s)];
      const double candidate = score[static_cast<std::size_t>(s)] + cell * cell;
      if (candidate < value) {
        value = candidate;
        arg = s;
      }
    }
    if (arg >= 0) {
      best[static_cast<std::size_t>(i)] = value;
      choice[i] = arg;
    }
    return arg;
  }
};

}  // namespace

std::vector<int> partition(const std::vector<double>& costs, int cells) {
  const int n = static_cast<int>(costs.size());
  GF_EXPECTS(n >= 1, "costs must not be empty");
  GF_EXPECTS(cells >= 1, "cells must be >= 1, got " + std::to_string(cells));
  GF_EXPECTS(cells <= n, "cells (" + std::to_string(cells) + ") must not exceed the number of layers (" +
                             std::to_string(n) + ")");
  std::vector<double> prefix(static_cast<std::size_t>(n + 1), 0.0);
  for (int i = 0; i < n; ++i) {
    const double c = costs[static_cast<std::size_t>(i)];
    GF_EXPECTS(std::isfinite(c) && c >= 0.0,
               "costs must be finite and non-negative; costs[" + std::to_string(i) + "] = " + std::to_string(c));
    prefix[static_cast<std::size_t>(i + 1)] = prefix[static_cast<std::size_t>(i)] + c;
  }

  // The bound is itself a difference of this same prefix array, so the optimal split's cells
  // compare <= it exactly. Any slack would admit splits with a worse bottleneck: an absolute
  // one swamps tiny costs (seconds per layer), a relative one swamps unit steps in huge ones.
  const double limit = min_bottleneck(prefix, cells);

  // Among splits with every cell <= limit, minimise the sum of squared cell costs.
  const auto width = static_cast<std::size_t>(n + 1);
  std::vector<double> score(width, kInf), next(width);
  std::vector<int> choice(static_cast<std::size_t>(cells) * width, -1);
  std::vector<int> window_start(width);
  score[0] = 0.0;  // zero layers in zero cells
  for (int j = 1; j <= cells; ++j) {
    std::fill(next.begin(), next.end(), kInf);
    // Prefixes that j - 1 cells can hold form an interval [j - 1, reach].
    int reach = j - 1;
    while (reach + 1 <= n && score[static_cast<std::size_t>(reach + 1)] != kInf) ++reach;
    // window_start[i]: smallest s with prefix[i] - prefix[s] <= limit; non-decreasing in i.
    int lo = 0;
    for (int i = 0; i <= n; ++i) {
      while (prefix[static_cast<std::size_t>(i)] - prefix[static_cast<std::size_t>(lo)] > limit) ++lo;
      window_start[static_cast<std::size_t>(i)] = lo;
    }
    ChooseSplits row{prefix, score, window_start, next, &choice[static_cast<std::size_t>(j - 1) * width],
                     j - 1, reach};
    row.solve(j, n - (cells - j), j - 1, n - 1);
    std::swap(score, next);
  }

  std::vector<int> balance(static_cast<std::size_t>(cells));
  int end = n;
  for (int j = cells; j >= 1; --j) {
    const int start = choice[static_cast<std::size_t>(j - 1) * width + static_cast<std::size_t>(end)];
    GF_EXPECTS(start >= 0, "internal error: partition found no split reaching its own bound");
    balance[static_cast<std::size_t>(j - 1)] = end - start;
    end = start;
  }
  return balance;
}

}  // namespace gpipe_fast
