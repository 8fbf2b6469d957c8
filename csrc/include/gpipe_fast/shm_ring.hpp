// A one-directional byte ring in shared memory: one writing process, one reading process.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "gpipe_fast/peer_process.hpp"
#include "gpipe_fast/shm_segment.hpp"

namespace gpipe_fast {

struct RingControl;  // the shared part: positions, wake-up words, who closed it and why

// The receiver creates the ring and the sender attaches to it. Bytes go in at the write
// position and come out at the read position (each advanced by its one side, which keeps a
// private cursor and publishes it); a waiting side spins for `spin` (busy for its first 20 us,
// then yielding the core between looks) then sleeps on a futex that the other side wakes only
// when told someone sleeps. Waits are bounded, and end with
// ChannelClosed once the ring is closed (by either side) or the other process has died.
//
// Thread rule: one thread at a time writes (callers serialise), one thread at a time reads;
// close() may come from any thread of either process.
class ShmRing {
 public:
  using Clock = std::chrono::steady_clock;
  // Now plus `seconds` (clamped to a day: callers pass timeouts, not forevers).
  static Clock::time_point deadline_in(double seconds);

  // The receiver's side: creates `name` with `capacity` bytes of ring (a power of two, at
  // least 4 KiB).
  static std::unique_ptr<ShmRing> create(const std::string& name, std::size_t capacity,
                                         std::chrono::nanoseconds spin);
  // The sender's side: attaches to `name` once its creator has set it up (at most `timeout_s`),
  // then removes the name (both sides now hold the memory).
  static std::unique_ptr<ShmRing> attach(const std::string& name, double timeout_s,
                                         std::chrono::nanoseconds spin);
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;
  ~ShmRing();  // unmaps; does not close (the owner decides, see close)

  // The creator's side: waits (at most `timeout_s`, else WaitTimeout) until the sender has
  // attached, then removes the name if the sender has not yet.
  void wait_attached(double timeout_s);
  bool attached() const;

  // -- the writing side ---------------------------------------------------------------------
  // Copies as much of `bytes` as there is room for after the private write cursor; returns
  // how much. Invisible to the reader until publish().
  std::size_t put(const void* bytes, std::size_t count);
  // Makes what put() wrote readable and wakes a sleeping reader.
  void publish();
  // Waits until some room is free (true), `deadline` passes (false), or the ring is closed or
  // the reader died (ChannelClosed).
  bool wait_for_room(Clock::time_point deadline);

  // -- the reading side ---------------------------------------------------------------------
  // Bytes published and not yet taken.
  std::size_t readable() const;
  // Copies up to `count` published bytes out; returns how many. The room is freed by release().
  std::size_t take(void* out, std::size_t count);
  // Frees what take() copied out and wakes a writer waiting for room.
  void release();
  // A debug mode (GPIPE_FAST_DEBUG_POISON): take() overwrites the bytes it copied out with
  // 0xFF, so that anything still reading a consumed slot sees NaNs, never plausible values.
  void set_poison(bool on) { poison_ = on; }
  // Waits until at least `count` bytes are readable (true), `deadline` passes (false), or the
  // ring is closed or the writer died with fewer readable (ChannelClosed).
  bool wait_for_bytes(std::size_t count, Clock::time_point deadline);

  // -- either side ---------------------------------------------------------------------------
  // Marks the ring closed (`failed`: because this side's step failed) with `reason`, and wakes
  // every waiter of both processes. Later closes keep the first reason. Data already
  // published stays readable.
  void close(const std::string& reason, bool failed);
  // Whether either side has closed the ring.
  bool closed() const;
  // ChannelClosed (naming who closed it, and why) when it is closed; `doing` says what the
  // caller was about to do.
  void throw_if_closed(const char* doing);
  std::size_t capacity() const { return capacity_; }
  const std::string& name() const { return segment_.name(); }

 private:
  ShmRing(ShmSegment segment, bool writer, std::chrono::nanoseconds spin);
  // Throws ChannelClosed naming who closed the ring and why, or that the peer died.
  [[noreturn]] void throw_closed(const char* doing);
  bool peer_alive();
  // Spins then sleeps on `seq` until ready() (true), `deadline` (false), or the ring closed
  // or the peer died without ready() (ChannelClosed saying what it was `doing`).
  template <typename Ready>
  bool wait(Ready ready, std::atomic<std::uint32_t>& seq, std::atomic<std::uint32_t>& sleeping,
            Clock::time_point deadline, const char* doing);

  ShmSegment segment_;
  RingControl* control_;
  std::byte* ring_;
  std::size_t capacity_;
  bool writer_;
  bool poison_ = false;
  std::chrono::nanoseconds spin_;
  std::uint64_t cursor_ = 0;  // private: the write position (writer) or read position (reader)
  std::mutex peer_mutex_;  // the reader learns its peer on the first look after the attach
  std::unique_ptr<PeerProcess> peer_;  // the other side's process, once known
};

}  // namespace gpipe_fast
