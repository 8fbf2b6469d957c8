// Ties a device's event clock to the host steady clock: pure arithmetic, no device calls.
#pragma once

#include <cstdint>

namespace gpipe_fast {

// A device event whose host steady-clock time is known: later events convert to host time
// by their elapsed time since it. The host time is estimated from a bracket (host clock
// read before recording the event and after waiting for it), so it is off by at most
// `uncertainty_ns` (half the bracket).
struct ClockAnchor {
  std::int64_t host_ns = 0;
  std::int64_t uncertainty_ns = 0;
};

// The anchor of an event recorded on an idle stream after `before_ns` and seen complete at
// `after_ns`: the bracket's midpoint.
ClockAnchor anchor_from_bracket(std::int64_t before_ns, std::int64_t after_ns);

// Host steady-clock ns of an event `elapsed_ms` after the anchor (cudaEventElapsedTime's
// float milliseconds). The float has a 24-bit significand, so an event t ms after the anchor
// is rounded by up to half an ulp of t: <= 0.03 us for t < 1 s, <= 0.25 us for t < 8 s, 2 us
// at one minute. Anchors are therefore renewed once older than kAnchorMaxAgeNs.
std::int64_t host_ns_after(const ClockAnchor& anchor, float elapsed_ms);

// Age after which an anchor is renewed (when no event timed against it is still unread):
// keeps a run's events within about a second plus the run's length of their anchor, so
// float rounding stays well under the events' own ~0.5 us resolution and the drift between
// the GPU's and the host's clock rates (tens of ppm) stays at microseconds.
inline constexpr std::int64_t kAnchorMaxAgeNs = 1'000'000'000;

// Whether an anchor tied at `anchor.host_ns` should be renewed at `now_ns`.
bool anchor_is_stale(const ClockAnchor& anchor, std::int64_t now_ns);

}  // namespace gpipe_fast
