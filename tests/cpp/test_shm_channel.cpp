// The shared-memory channel within one process (two threads) and against a forked peer.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/shm_channel.hpp"
#include "gpipe_fast/shm_segment.hpp"

using gpipe_fast::ChannelClosed;
using gpipe_fast::InvalidArgument;
using gpipe_fast::ShmMessage;
using gpipe_fast::ShmPart;
using gpipe_fast::ShmReceiver;
using gpipe_fast::ShmSegment;
using gpipe_fast::ShmSender;
using gpipe_fast::WaitTimeout;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kSpin = std::chrono::microseconds(5);

std::string unique_name(const char* what) {
  static int counter = 0;
  return "/gpf-cpptest-" + std::to_string(::getpid()) + "-" + what + "-" +
         std::to_string(counter++);
}

bool name_exists(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) ::close(fd);
  return fd >= 0;
}

struct Pair {
  std::string name;
  ShmReceiver receiver;
  ShmSender sender;
  explicit Pair(const char* what, std::size_t ring = 4096)
      : name(unique_name(what)), receiver(name, ring, kSpin), sender(name, 1.0, kSpin) {
    receiver.wait_attached(1.0);
  }
};

std::vector<std::uint8_t> pattern(std::size_t bytes, std::uint8_t seed) {
  std::vector<std::uint8_t> out(bytes);
  for (std::size_t i = 0; i < bytes; ++i) out[i] = static_cast<std::uint8_t>(seed + i * 7);
  return out;
}

bool same(const ShmMessage& message, std::size_t offset, const std::vector<std::uint8_t>& expected) {
  return offset + expected.size() <= message.size() &&
         std::memcmp(message.data() + offset, expected.data(), expected.size()) == 0;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

TEST(shm_parts_are_gathered_at_aligned_offsets_and_the_name_is_gone_once_attached) {
  Pair pair("gather");
  CHECK(!name_exists(pair.name));
  const auto a = pattern(5, 1);
  const auto b = pattern(40, 2);
  CHECK(pair.sender.send(11, {{a.data(), a.size()}, {b.data(), b.size()}}));
  auto message = pair.receiver.receive(11, 1.0);
  CHECK_EQ(message->tag(), 11u);
  CHECK_EQ(message->size(), 16u + 48u);
  CHECK(same(*message, 0, a));
  CHECK(same(*message, 16, b));
  CHECK_EQ(reinterpret_cast<std::uintptr_t>(message->data()) % 64, 0u);
  CHECK(pair.sender.send(12, {}));
  CHECK_EQ(pair.receiver.receive(12, 1.0)->size(), 0u);
}

// Whether `bytes` occur anywhere in the mapping `spy`.
bool holds(const ShmSegment& spy, const std::vector<std::uint8_t>& bytes) {
  const auto* begin = static_cast<const std::uint8_t*>(spy.data());
  return std::search(begin, begin + spy.size(), bytes.begin(), bytes.end()) != begin + spy.size();
}

TEST(shm_poison_overwrites_the_ring_bytes_a_receive_consumed) {
  for (const bool poison : {false, true}) {
    const std::string name = unique_name(poison ? "poison" : "plain");
    ShmReceiver receiver(name, 4096, kSpin, poison);
    // A third mapping of the ring, opened before the sender's attach removes the name.
    const ShmSegment spy = ShmSegment::open(name, 1.0);
    ShmSender sender(name, 1.0, kSpin);
    receiver.wait_attached(1.0);
    const auto body = pattern(200, 3);
    CHECK(sender.send(7, {{body.data(), body.size()}}));
    CHECK(holds(spy, body));
    auto message = receiver.receive(7, 1.0);
    CHECK(same(*message, 0, body));  // the message owns a copy, poisoned or not
    CHECK_EQ(holds(spy, body), !poison);
    CHECK_EQ(holds(spy, std::vector<std::uint8_t>(body.size(), 0xFF)), poison);
  }
}

TEST(shm_messages_with_other_tags_are_kept_aside_until_asked_for) {
  Pair pair("tags");
  std::vector<std::vector<std::uint8_t>> bodies;
  for (std::uint8_t i = 0; i < 4; ++i) bodies.push_back(pattern(100 + i, i));
  for (std::size_t i = 0; i < bodies.size(); ++i) {
    pair.sender.send(100 + i, {{bodies[i].data(), bodies[i].size()}});
  }
  CHECK(same(*pair.receiver.receive(103, 1.0), 0, bodies[3]));
  CHECK_EQ(pair.receiver.set_aside(), 3u);
  CHECK(same(*pair.receiver.receive(101, 1.0), 0, bodies[1]));
  CHECK(same(*pair.receiver.receive(100, 1.0), 0, bodies[0]));
  CHECK(same(*pair.receiver.receive(102, 1.0), 0, bodies[2]));
  CHECK_EQ(pair.receiver.set_aside(), 0u);
}

TEST(shm_a_message_larger_than_the_ring_streams_through_it) {
  Pair pair("stream");
  const auto big = pattern(1 << 20, 9);  // 256 rings' worth
  const auto start = Clock::now();
  CHECK(!pair.sender.send(7, {{big.data(), big.size()}}));  // queued: the ring is 4 KiB
  CHECK(seconds_since(start) < 0.5);
  auto message = pair.receiver.receive(7, 5.0);
  CHECK(same(*message, 0, big));
  pair.sender.flush(1.0);
  CHECK_EQ(pair.sender.queued_bytes(), 0u);
}

TEST(shm_a_full_ring_does_not_block_the_sender_and_order_is_kept) {
  Pair pair("full");
  std::vector<std::vector<std::uint8_t>> bodies;
  for (std::uint8_t i = 0; i < 64; ++i) bodies.push_back(pattern(1000, i));
  const auto start = Clock::now();
  int direct = 0;
  for (std::size_t i = 0; i < bodies.size(); ++i) {
    direct += pair.sender.send(i, {{bodies[i].data(), bodies[i].size()}}) ? 1 : 0;
  }
  CHECK(seconds_since(start) < 0.5);
  CHECK(direct >= 1 && direct < 64);
  CHECK(pair.sender.queued_bytes() > 0);
  CHECK_THROWS(pair.sender.flush(0.05), WaitTimeout);  // nobody reads yet
  for (std::size_t i = 0; i < bodies.size(); ++i) {
    CHECK(same(*pair.receiver.receive(i, 1.0), 0, bodies[i]));
  }
  pair.sender.flush(1.0);
  CHECK_EQ(pair.receiver.set_aside(), 0u);
}

TEST(shm_a_receive_times_out_and_a_later_one_finishes_the_message) {
  Pair pair("timeout");
  const auto start = Clock::now();
  CHECK_THROWS(pair.receiver.receive(1, 0.05), WaitTimeout);
  const double waited = seconds_since(start);
  CHECK(waited >= 0.05 && waited < 0.5);
  const auto big = pattern(64 * 1024, 3);
  pair.sender.send(1, {{big.data(), big.size()}});  // partly in the ring, partly queued
  std::thread reader([&] {
    std::shared_ptr<ShmMessage> message;
    while (!message) {
      try {
        message = pair.receiver.receive(1, 0.001);  // slices that may end mid-message
      } catch (const WaitTimeout&) {
      }
    }
    CHECK(same(*message, 0, big));
  });
  reader.join();
}

TEST(shm_closing_either_side_ends_the_other_sides_waits_at_once) {
  {
    Pair pair("close-sender");
    const auto body = pattern(10, 1);
    pair.sender.send(5, {{body.data(), body.size()}});
    std::thread closer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      pair.sender.close("rank 1 failed", true);
    });
    CHECK(same(*pair.receiver.receive(5, 1.0), 0, body));  // sent before the close: delivered
    const auto start = Clock::now();
    CHECK_THROWS(pair.receiver.receive(6, 10.0), ChannelClosed);
    CHECK(seconds_since(start) < 1.0);
    closer.join();
  }
  {
    Pair pair("close-receiver");
    const auto big = pattern(1 << 16, 1);
    pair.sender.send(5, {{big.data(), big.size()}});  // queued: waits for room
    pair.receiver.close("rank 0 failed", true);
    const auto start = Clock::now();
    CHECK_THROWS(pair.sender.flush(10.0), ChannelClosed);
    CHECK(seconds_since(start) < 1.0);
    CHECK_THROWS(pair.sender.send(6, {}), ChannelClosed);
    CHECK_EQ(pair.sender.queued_bytes(), 0u);
  }
}

TEST(shm_a_peer_that_dies_without_closing_ends_the_wait) {
  const std::string name = unique_name("death");
  ShmReceiver receiver(name, 4096, kSpin);
  const pid_t child = ::fork();
  if (child == 0) {  // the sender: one message, then killed-like exit (no close, no cleanup)
    try {
      ShmSender sender(name, 5.0, kSpin);
      const std::uint64_t value = 42;
      sender.send(1, {{&value, sizeof value}});
      ::_exit(0);  // skips ShmSender's destructor, as SIGKILL would
    } catch (...) {
      ::_exit(3);
    }
  }
  receiver.wait_attached(5.0);
  auto message = receiver.receive(1, 5.0);
  CHECK_EQ(message->size(), 16u);
  const auto start = Clock::now();
  CHECK_THROWS(receiver.receive(2, 10.0), ChannelClosed);  // the child is a zombie until reaped
  CHECK(seconds_since(start) < 1.0);
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(!name_exists(name));
}

TEST(shm_names_and_sizes_are_checked) {
  CHECK_THROWS(ShmReceiver("no-slash", 4096, kSpin), InvalidArgument);
  CHECK_THROWS(ShmReceiver(unique_name("size"), 5000, kSpin), InvalidArgument);
  const std::string name = unique_name("twice");
  ShmReceiver first(name, 4096, kSpin);
  CHECK(name_exists(name));
  CHECK_THROWS(ShmReceiver(name, 4096, kSpin), std::runtime_error);
  CHECK_THROWS(ShmSender(unique_name("absent"), 0.01, kSpin), WaitTimeout);
}

TEST(shm_a_receiver_whose_sender_never_came_removes_its_name) {
  const std::string name = unique_name("orphan");
  {
    ShmReceiver receiver(name, 4096, kSpin);
    CHECK_THROWS(receiver.wait_attached(0.01), WaitTimeout);
    CHECK(name_exists(name));
  }
  CHECK(!name_exists(name));
}
