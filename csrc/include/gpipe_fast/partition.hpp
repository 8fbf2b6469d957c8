// Optimal contiguous partition of per-layer costs into K cells.
#pragma once

#include <vector>

namespace gpipe_fast {

// Splits `costs` (one non-negative finite cost per layer) into `cells` contiguous, non-empty
// cells and returns the number of layers in each. The split minimises the largest cell cost
// exactly; among the splits that reach it, the one with the smallest sum of squared cell
// costs (the most balanced) is chosen.
std::vector<int> partition(const std::vector<double>& costs, int cells);

}  // namespace gpipe_fast
