// Task clocks without a GPU: the anchor arithmetic of the CUDA clock, and the host clock.
#include <cmath>
#include <cstdint>
#include <limits>

#include "check.hpp"
#include "gpipe_fast/clock_anchor.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/task_clock.hpp"

using gpipe_fast::ClockAnchor;
using gpipe_fast::InvalidArgument;
using gpipe_fast::Stamp;
using gpipe_fast::Stream;

TEST(anchor_from_bracket_takes_the_midpoint_and_half_the_width) {
  const ClockAnchor even = gpipe_fast::anchor_from_bracket(1'000, 1'010);
  CHECK_EQ(even.host_ns, std::int64_t{1'005});
  CHECK_EQ(even.uncertainty_ns, std::int64_t{5});
  // An odd width: the halves add up to the whole bracket.
  const ClockAnchor odd = gpipe_fast::anchor_from_bracket(1'000, 1'007);
  CHECK_EQ(odd.host_ns, std::int64_t{1'003});
  CHECK_EQ(odd.uncertainty_ns, std::int64_t{4});
  const ClockAnchor point = gpipe_fast::anchor_from_bracket(42, 42);
  CHECK_EQ(point.host_ns, std::int64_t{42});
  CHECK_EQ(point.uncertainty_ns, std::int64_t{0});
  CHECK_THROWS(gpipe_fast::anchor_from_bracket(10, 9), InvalidArgument);
}

TEST(host_ns_after_adds_the_elapsed_milliseconds) {
  const ClockAnchor anchor{5'000'000'000'000, 3};
  CHECK_EQ(gpipe_fast::host_ns_after(anchor, 0.0f), anchor.host_ns);
  CHECK_EQ(gpipe_fast::host_ns_after(anchor, 1.5f), anchor.host_ns + 1'500'000);
  CHECK_EQ(gpipe_fast::host_ns_after(anchor, 0.25f), anchor.host_ns + 250'000);
  // cudaEventElapsedTime's resolution is about half a microsecond.
  CHECK_EQ(gpipe_fast::host_ns_after(anchor, 0.0005f), anchor.host_ns + 500);
  // Two events on one device keep their order, to the nanosecond.
  CHECK(gpipe_fast::host_ns_after(anchor, 2.0f) < gpipe_fast::host_ns_after(anchor, 2.001f));
}

TEST(host_ns_after_rounding_stays_within_the_documented_bounds) {
  // The float milliseconds are the only lossy step: an event t after the anchor lands within
  // half a float ulp of t (clock_anchor.hpp): 0.03 us below 1 s, 0.25 us below 8 s.
  const ClockAnchor anchor{0, 0};
  const struct {
    std::int64_t exact_ns;
    std::int64_t bound_ns;
  } cases[] = {{999'999'937, 31}, {123'456'789, 8}, {8'000'123'457, 245}, {60'000'000'777, 1954}};
  for (const auto& c : cases) {
    const float elapsed_ms = static_cast<float>(static_cast<double>(c.exact_ns) / 1e6);
    const std::int64_t error = gpipe_fast::host_ns_after(anchor, elapsed_ms) - c.exact_ns;
    CHECK(std::llabs(error) <= c.bound_ns);
  }
}

TEST(anchor_goes_stale_after_its_maximum_age) {
  const ClockAnchor anchor{1'000, 0};
  CHECK(!gpipe_fast::anchor_is_stale(anchor, 1'000));
  CHECK(!gpipe_fast::anchor_is_stale(anchor, 1'000 + gpipe_fast::kAnchorMaxAgeNs));
  CHECK(gpipe_fast::anchor_is_stale(anchor, 1'001 + gpipe_fast::kAnchorMaxAgeNs));
}

TEST(host_clock_reads_the_steady_clock_at_once) {
  auto clock = gpipe_fast::make_host_clock();
  const Stream host_stream{};
  CHECK_EQ(clock->name(host_stream), std::string("host"));
  clock->calibrate({host_stream, Stream{0, 0}});  // nothing to tie: no device calls
  const std::int64_t before = gpipe_fast::steady_now_ns();
  const Stamp stamp = clock->stamp(host_stream);
  const std::int64_t after = gpipe_fast::steady_now_ns();
  CHECK_EQ(stamp.event, std::int64_t{-1});
  CHECK(before <= stamp.ns && stamp.ns <= after);
  CHECK_EQ(clock->resolve(stamp), stamp.ns);
  CHECK_THROWS(clock->resolve(Stamp{0, 7}), InvalidArgument);
  clock->discard(stamp);
  CHECK_EQ(clock->live_events(), std::int64_t{0});
  CHECK_EQ(clock->pooled_events(), std::int64_t{0});
}

#ifndef GPIPE_FAST_WITH_CUDA
TEST(cuda_clock_is_refused_without_cuda) {
  CHECK_THROWS(gpipe_fast::make_cuda_clock(), gpipe_fast::CudaError);
}
#endif
