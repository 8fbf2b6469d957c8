// Tagged messages between two processes of one host over a shared-memory ring (shm_ring.hpp).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "gpipe_fast/shm_ring.hpp"

namespace gpipe_fast {

// Each part of a message starts at an offset of the message aligned to this (the receiver
// views its tensors in place; gpipe_fast/transport/wire.py's ALIGN is the same).
constexpr std::size_t kShmPartAlign = 16;

// One part of a message to send: `bytes` bytes at `data`, gathered into the ring as they are.
struct ShmPart {
  const void* data;
  std::size_t bytes;
};

// A received message: its tag and its bytes, owned, 64-byte aligned, each part at an offset
// aligned to kShmPartAlign (padding between parts). `poison`: its bytes are overwritten with
// 0xFF when it goes (the debug mode of ShmRing::set_poison).
class ShmMessage {
 public:
  ShmMessage(std::uint64_t tag, std::size_t bytes, bool poison = false);
  ShmMessage(const ShmMessage&) = delete;
  ShmMessage& operator=(const ShmMessage&) = delete;
  ~ShmMessage();

  std::uint64_t tag() const { return tag_; }
  std::size_t size() const { return size_; }
  std::byte* data() const { return data_; }

 private:
  std::uint64_t tag_;
  std::size_t size_;
  std::byte* data_;
  bool poison_;
};

// The sending end of one ring. send() never waits for the receiver (a pipeline's send that
// waited could deadlock against the peer's own sends): a message goes straight into the ring
// when nothing is queued, as far as there is room, and the rest is copied and queued for this
// channel's flusher thread, which streams it in as the receiver frees room. Several threads
// of this process may send at once (one lock); messages leave in the order of their send().
class ShmSender {
 public:
  // Attaches to the ring `name` that the receiver created, waiting up to `timeout_s` for it.
  ShmSender(const std::string& name, double timeout_s, std::chrono::nanoseconds spin);
  ShmSender(const ShmSender&) = delete;
  ShmSender& operator=(const ShmSender&) = delete;
  ~ShmSender();  // closes the ring (what is queued is dropped) and stops the flusher

  // Sends `parts` as one message tagged `tag`. True when it went into the ring whole; false
  // when (part of) it was queued. ChannelClosed when the ring is closed or the flusher failed.
  bool send(std::uint64_t tag, const std::vector<ShmPart>& parts);
  // Waits until everything queued is in the ring: WaitTimeout after `timeout_s`, ChannelClosed
  // when it never will be (the receiver closed the ring or died).
  void flush(double timeout_s);
  // Marks the ring closed for both sides (`failed`: this rank's step failed) and drops the
  // queue; the receiver still reads what the ring already holds, then gets ChannelClosed.
  void close(const std::string& reason, bool failed);
  std::size_t queued_bytes() const;
  const std::string& name() const { return ring_->name(); }

 private:
  // A message's bytes not yet in the ring, copied out of the caller's buffers.
  struct Pending {
    std::vector<std::byte> bytes;
    std::size_t written = 0;
  };
  void flush_queue();  // the flusher thread's loop
  void fail(const std::string& error);  // under mutex_: records the flusher's error
  [[noreturn]] void throw_failure() const;  // under mutex_

  std::unique_ptr<ShmRing> ring_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;  // the queue grew or shrank, or the channel stopped
  std::deque<Pending> queue_;        // while non-empty, only the flusher writes to the ring
  std::size_t queued_bytes_ = 0;
  std::optional<std::string> error_;  // why nothing more can be sent
  bool stopping_ = false;
  std::thread flusher_;  // started with the first queued message
};

// The receiving end of one ring, which it creates. receive() hands out the message with the
// tag asked for: messages with other tags met on the way are kept aside until asked for, so
// the receiving order need not be the sending order. One thread at a time receives.
class ShmReceiver {
 public:
  // Creates the ring `name` with `ring_bytes` of room (a power of two, at least 4 KiB).
  // `poison`: the debug mode that overwrites every consumed ring byte, and every message's
  // bytes once it goes, with 0xFF (ShmRing::set_poison).
  ShmReceiver(const std::string& name, std::size_t ring_bytes, std::chrono::nanoseconds spin,
              bool poison = false);
  ShmReceiver(const ShmReceiver&) = delete;
  ShmReceiver& operator=(const ShmReceiver&) = delete;
  ~ShmReceiver();  // closes the ring and removes its name if the sender never attached

  // Waits until the sender attached (then the name is removed), at most `timeout_s`.
  void wait_attached(double timeout_s);
  // The next message tagged `tag`. WaitTimeout when none completed within `timeout_s` (what
  // arrived of it is kept: the next call goes on from there); ChannelClosed when the sender
  // closed the ring or died before sending it.
  std::shared_ptr<ShmMessage> receive(std::uint64_t tag, double timeout_s);
  void close(const std::string& reason, bool failed);
  // Messages kept aside, received and not yet asked for.
  std::size_t set_aside() const;
  const std::string& name() const { return ring_->name(); }

 private:
  // A message whose bytes are still arriving.
  struct Incoming {
    std::shared_ptr<ShmMessage> message;
    std::size_t received = 0;
  };
  // Reads on into `incoming_` until a message is complete (returned) or `deadline` passes
  // (nullptr).
  std::shared_ptr<ShmMessage> next_message(ShmRing::Clock::time_point deadline);

  std::unique_ptr<ShmRing> ring_;
  bool poison_;
  std::mutex receiving_;  // one receive at a time
  std::optional<Incoming> incoming_;
  mutable std::mutex aside_mutex_;
  std::unordered_map<std::uint64_t, std::deque<std::shared_ptr<ShmMessage>>> aside_;
  std::size_t aside_count_ = 0;
};

}  // namespace gpipe_fast
