// The shared-memory byte ring: its shared layout, copies across the wrap, futex waits, closing.
#include "gpipe_fast/shm_ring.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <thread>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {

namespace {

constexpr std::uint64_t kReady = 0x67706673686d3031ULL;  // "gpfshm01": set up and this layout
constexpr std::size_t kControlBytes = 4096;               // the ring's bytes start a page in
constexpr std::size_t kReasonBytes = 512;
// A futex sleep is cut into slices this long, so that a peer killed without closing the ring
// is noticed (a futex is not woken by a death).
constexpr auto kLivenessSlice = std::chrono::milliseconds(10);
// The first part of a wait's spin is busy; the rest yields the core between looks, so that a
// runnable thread of this host gets it while this one keeps its CPU from going idle (waking
// an idle CPU, a virtual one above all, costs far more than a yield).
constexpr auto kBusySpin = std::chrono::microseconds(20);

// Bits of RingControl::closed.
constexpr std::uint32_t kClosedByWriter = 1;
constexpr std::uint32_t kClosedByReader = 2;
constexpr std::uint32_t kFailed = 4;
constexpr std::uint32_t kReasonWritten = 8;

static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "positions are shared lock-free");
static_assert(sizeof(std::atomic<std::uint32_t>) == 4, "futex words are 32-bit");

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Sleeps while *word == expected, at most `timeout`; true when the time ran out. Process-shared
// (no FUTEX_PRIVATE_FLAG): the word lives in memory mapped by two processes.
bool futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected,
                std::chrono::nanoseconds timeout) {
  const auto ns = std::max<std::int64_t>(timeout.count(), 0);
  timespec relative{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  const long result = ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT,
                                expected, &relative, nullptr, 0);
  return result != 0 && errno == ETIMEDOUT;  // EAGAIN (word changed) and EINTR: re-check
}

void futex_wake_all(std::atomic<std::uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr,
            nullptr, 0);
}

}  // namespace

// The ring's first page, in shared memory. Each side's hot words sit on their own cache line:
// the writer stores `head` and reads `tail`, the reader the other way round.
struct RingControl {
  std::atomic<std::uint64_t> magic;  // kReady once the creator has filled in the rest
  std::uint64_t capacity;
  std::int32_t creator_pid;
  std::atomic<std::int32_t> attacher_pid;  // 0 until the sender attached
  std::atomic<std::uint32_t> attached;     // futex word: 1 once the sender attached
  std::atomic<std::uint32_t> reason_claimed;  // the first closer writes `reason`
  std::atomic<std::uint32_t> closed;          // kClosedBy* | kFailed | kReasonWritten
  char reason[kReasonBytes];

  alignas(64) std::atomic<std::uint64_t> head;  // bytes published by the writer, ever
  std::atomic<std::uint32_t> data_seq;          // futex word the reader sleeps on
  std::atomic<std::uint32_t> reader_sleeping;

  alignas(64) std::atomic<std::uint64_t> tail;  // bytes released by the reader, ever
  std::atomic<std::uint32_t> room_seq;          // futex word the writer sleeps on
  std::atomic<std::uint32_t> writer_sleeping;
};
static_assert(sizeof(RingControl) <= kControlBytes, "the control block fits its page");

ShmRing::Clock::time_point ShmRing::deadline_in(double seconds) {
  const double bounded = std::clamp(seconds, 0.0, 86400.0);
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(bounded));
}

ShmRing::ShmRing(ShmSegment segment, bool writer, std::chrono::nanoseconds spin)
    : segment_(std::move(segment)),
      control_(static_cast<RingControl*>(segment_.data())),
      ring_(static_cast<std::byte*>(segment_.data()) + kControlBytes),
      capacity_(segment_.size() - kControlBytes),
      writer_(writer),
      spin_(spin) {}

ShmRing::~ShmRing() = default;

std::unique_ptr<ShmRing> ShmRing::create(const std::string& name, std::size_t capacity,
                                         std::chrono::nanoseconds spin) {
  GF_EXPECTS(capacity >= 4096 && (capacity & (capacity - 1)) == 0,
             "a shared-memory ring's capacity is a power of two of at least 4096 bytes, got " +
                 std::to_string(capacity));
  auto segment = ShmSegment::create(name, kControlBytes + capacity);
  auto* control = new (segment.data()) RingControl{};  // on zeroed memory; the atomics start 0
  control->capacity = capacity;
  control->creator_pid = static_cast<std::int32_t>(::getpid());
  control->magic.store(kReady, std::memory_order_release);
  return std::unique_ptr<ShmRing>(new ShmRing(std::move(segment), false, spin));
}

std::unique_ptr<ShmRing> ShmRing::attach(const std::string& name, double timeout_s,
                                         std::chrono::nanoseconds spin) {
  const auto deadline = deadline_in(timeout_s);
  auto segment = ShmSegment::open(name, timeout_s);
  GF_EXPECTS(segment.size() > kControlBytes, "shared memory '" + name + "' is not a ring");
  auto* control = static_cast<RingControl*>(segment.data());
  while (control->magic.load(std::memory_order_acquire) != kReady) {
    if (Clock::now() >= deadline) {
      throw WaitTimeout("gpipe_fast: shared memory '" + name +
                        "' was not set up as a gpipe_fast ring within " +
                        std::to_string(timeout_s) + " s");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (control->capacity != segment.size() - kControlBytes) {
    throw std::runtime_error("gpipe_fast: shared memory '" + name + "' holds a ring of " +
                             std::to_string(control->capacity) + " bytes in a file of " +
                             std::to_string(segment.size()) + ": not one of ours");
  }
  GF_EXPECTS(control->attached.load() == 0,
             "shared memory '" + name + "' has a sender attached already");
  std::unique_ptr<ShmRing> ring(new ShmRing(std::move(segment), true, spin));
  ring->peer_ = std::make_unique<PeerProcess>(control->creator_pid);
  control->attacher_pid.store(static_cast<std::int32_t>(::getpid()), std::memory_order_release);
  control->attached.store(1, std::memory_order_release);
  futex_wake_all(control->attached);
  ring->segment_.unlink();  // both sides hold it now: nothing is left in /dev/shm
  return ring;
}

bool ShmRing::attached() const { return control_->attached.load(std::memory_order_acquire) != 0; }

void ShmRing::wait_attached(double timeout_s) {
  const auto deadline = deadline_in(timeout_s);
  while (!attached()) {
    const auto now = Clock::now();
    if (now >= deadline) {
      throw WaitTimeout("gpipe_fast: no sender attached to shared memory '" + name() +
                        "' within " + std::to_string(timeout_s) + " s");
    }
    futex_wait(control_->attached, 0, std::min<Clock::duration>(deadline - now, kLivenessSlice));
  }
  segment_.unlink();
}

// -- writing ----------------------------------------------------------------------------------

std::size_t ShmRing::put(const void* bytes, std::size_t count) {
  const std::uint64_t tail = control_->tail.load(std::memory_order_acquire);
  const std::size_t room = capacity_ - static_cast<std::size_t>(cursor_ - tail);
  const std::size_t n = std::min(count, room);
  const std::size_t offset = static_cast<std::size_t>(cursor_) & (capacity_ - 1);
  const std::size_t first = std::min(n, capacity_ - offset);
  std::memcpy(ring_ + offset, bytes, first);
  std::memcpy(ring_, static_cast<const std::byte*>(bytes) + first, n - first);
  cursor_ += n;
  return n;
}

void ShmRing::publish() {
  // seq_cst store then seq_cst load, against the reader's store of reader_sleeping then load of
  // head: one of the two sees the other, so a wake-up is never lost.
  control_->head.store(cursor_, std::memory_order_seq_cst);
  if (control_->reader_sleeping.load(std::memory_order_seq_cst) != 0) {
    control_->data_seq.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(control_->data_seq);
  }
}

bool ShmRing::wait_for_room(Clock::time_point deadline) {
  auto has_room = [this] {
    return cursor_ - control_->tail.load(std::memory_order_seq_cst) < capacity_;
  };
  return wait(has_room, control_->room_seq, control_->writer_sleeping, deadline,
              "waiting for room in the ring");
}

// -- reading ----------------------------------------------------------------------------------

std::size_t ShmRing::readable() const {
  return static_cast<std::size_t>(control_->head.load(std::memory_order_acquire) - cursor_);
}

std::size_t ShmRing::take(void* out, std::size_t count) {
  const std::size_t n = std::min(count, readable());
  const std::size_t offset = static_cast<std::size_t>(cursor_) & (capacity_ - 1);
  const std::size_t first = std::min(n, capacity_ - offset);
  std::memcpy(out, ring_ + offset, first);
  std::memcpy(static_cast<std::byte*>(out) + first, ring_, n - first);
  if (poison_) {
    std::memset(ring_ + offset, 0xFF, first);
    std::memset(ring_, 0xFF, n - first);
  }
  cursor_ += n;
  return n;
}

void ShmRing::release() {
  control_->tail.store(cursor_, std::memory_order_seq_cst);
  if (control_->writer_sleeping.load(std::memory_order_seq_cst) != 0) {
    control_->room_seq.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(control_->room_seq);
  }
}

bool ShmRing::wait_for_bytes(std::size_t count, Clock::time_point deadline) {
  auto has_bytes = [this, count] {
    return control_->head.load(std::memory_order_seq_cst) - cursor_ >= count;
  };
  return wait(has_bytes, control_->data_seq, control_->reader_sleeping, deadline,
              "waiting for a message");
}

// -- waiting and closing ----------------------------------------------------------------------

template <typename Ready>
bool ShmRing::wait(Ready ready, std::atomic<std::uint32_t>& seq,
                   std::atomic<std::uint32_t>& sleeping, Clock::time_point deadline,
                   const char* doing) {
  if (ready()) return true;
  // The spin: a reply often comes within microseconds, sooner than a futex round trip.
  const auto start = Clock::now();
  const auto busy_end = std::min(start + std::min<Clock::duration>(spin_, kBusySpin), deadline);
  const auto spin_end = std::min(start + spin_, deadline);
  while (Clock::now() < busy_end && !closed()) {
    for (int i = 0; i < 64; ++i) cpu_relax();
    if (ready()) return true;
  }
  while (Clock::now() < spin_end && !closed()) {
    std::this_thread::yield();
    if (ready()) return true;
  }
  for (;;) {
    const std::uint32_t observed = seq.load(std::memory_order_seq_cst);
    sleeping.store(1, std::memory_order_seq_cst);
    if (ready()) {
      sleeping.store(0, std::memory_order_relaxed);
      return true;
    }
    if (closed()) {
      sleeping.store(0, std::memory_order_relaxed);
      throw_closed(doing);
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      sleeping.store(0, std::memory_order_relaxed);
      return false;
    }
    const bool slept_out =
        futex_wait(seq, observed, std::min<Clock::duration>(deadline - now, kLivenessSlice));
    sleeping.store(0, std::memory_order_relaxed);
    if (slept_out && !ready() && !peer_alive()) throw_closed(doing);
  }
}

bool ShmRing::closed() const { return control_->closed.load(std::memory_order_acquire) != 0; }

void ShmRing::close(const std::string& reason, bool failed) {
  const std::uint32_t side = writer_ ? kClosedByWriter : kClosedByReader;
  std::uint32_t bits = side | (failed ? kFailed : 0);
  if (control_->reason_claimed.exchange(1, std::memory_order_acq_rel) == 0) {
    const std::size_t n = std::min(reason.size(), kReasonBytes - 1);
    std::memcpy(control_->reason, reason.data(), n);
    control_->reason[n] = '\0';
    bits |= kReasonWritten;
  }
  control_->closed.fetch_or(bits, std::memory_order_seq_cst);
  // Every sleeper of both processes re-checks and sees `closed`.
  control_->data_seq.fetch_add(1, std::memory_order_seq_cst);
  control_->room_seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(control_->data_seq);
  futex_wake_all(control_->room_seq);
}

void ShmRing::throw_if_closed(const char* doing) {
  if (closed()) throw_closed(doing);
}

bool ShmRing::peer_alive() {
  std::lock_guard<std::mutex> lock(peer_mutex_);
  if (!peer_) {
    const std::int32_t pid = control_->attacher_pid.load(std::memory_order_acquire);
    if (pid == 0) return true;  // no sender yet: the caller's own timeout bounds the wait
    peer_ = std::make_unique<PeerProcess>(pid);
  }
  return peer_->alive();
}

void ShmRing::throw_closed(const char* doing) {
  const std::uint32_t bits = control_->closed.load(std::memory_order_acquire);
  std::string message = "gpipe_fast: shared-memory channel '" + name() + "' ";
  if (bits == 0) {
    const pid_t pid = writer_ ? control_->creator_pid : control_->attacher_pid.load();
    message += "lost its " + std::string(writer_ ? "receiver" : "sender") + ": process " +
               std::to_string(pid) + " exited";
  } else {
    const bool by_writer = (bits & kClosedByWriter) != 0;
    const bool here = by_writer == writer_;
    message += "was closed by " +
               std::string(here ? "this process" : (by_writer ? "the sender" : "the receiver"));
    if (bits & kFailed) message += " after a failure";
    if (bits & kReasonWritten) message += std::string(": ") + control_->reason;
  }
  throw ChannelClosed(message + " (" + doing + ")");
}

}  // namespace gpipe_fast
