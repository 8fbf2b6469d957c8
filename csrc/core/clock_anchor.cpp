// Anchor arithmetic between a device's event clock and the host steady clock.
#include "gpipe_fast/clock_anchor.hpp"

#include <cmath>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {

ClockAnchor anchor_from_bracket(std::int64_t before_ns, std::int64_t after_ns) {
  GF_EXPECTS(before_ns <= after_ns, "a clock bracket must not end before it starts");
  const std::int64_t half = (after_ns - before_ns) / 2;
  return ClockAnchor{before_ns + half, after_ns - before_ns - half};
}

std::int64_t host_ns_after(const ClockAnchor& anchor, float elapsed_ms) {
  // In double the product is exact (24-bit float times 1e6 needs < 53 bits), so rounding
  // to whole nanoseconds is the only loss on top of the float's own.
  return anchor.host_ns + std::llround(static_cast<double>(elapsed_ms) * 1e6);
}

bool anchor_is_stale(const ClockAnchor& anchor, std::int64_t now_ns) {
  return now_ns - anchor.host_ns > kAnchorMaxAgeNs;
}

}  // namespace gpipe_fast
