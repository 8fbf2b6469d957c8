// Framing, gathering, queueing and tag matching of messages over a shared-memory ring.
#include "gpipe_fast/shm_channel.hpp"

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {

namespace {

// What precedes each message in the ring.
struct Frame {
  std::uint64_t tag;
  std::uint64_t bytes;  // of the message, padding included (a multiple of kShmPartAlign)
};
static_assert(sizeof(Frame) == kShmPartAlign, "frames keep every message aligned");

// A frame announcing more than this is not one the sender wrote: the memory was trampled.
constexpr std::uint64_t kMaxMessageBytes = std::uint64_t{1} << 40;
constexpr std::align_val_t kMessageAlign{64};
// How long the flusher sleeps at most between looks at whether it should stop.
constexpr auto kFlusherSlice = std::chrono::milliseconds(100);
const std::byte kZeros[kShmPartAlign] = {};

std::size_t aligned(std::size_t bytes) {
  return (bytes + kShmPartAlign - 1) / kShmPartAlign * kShmPartAlign;
}

// The byte stream of one message: its frame, then each part followed by its padding.
struct Stream {
  Frame frame;
  std::vector<ShmPart> pieces;
  std::size_t total = 0;

  Stream(std::uint64_t tag, const std::vector<ShmPart>& parts) : frame{tag, 0} {
    pieces.reserve(1 + 2 * parts.size());
    pieces.push_back({&frame, sizeof(Frame)});
    for (const ShmPart& part : parts) {
      GF_EXPECTS(part.data != nullptr || part.bytes == 0, "a message part has no data");
      pieces.push_back(part);
      const std::size_t padding = aligned(part.bytes) - part.bytes;
      if (padding > 0) pieces.push_back({kZeros, padding});
      frame.bytes += aligned(part.bytes);
    }
    total = sizeof(Frame) + frame.bytes;
  }

  // Puts the stream's bytes from `offset` into `ring` while there is room; the new offset.
  std::size_t put(ShmRing& ring, std::size_t offset) const {
    std::size_t start = 0;
    for (const ShmPart& piece : pieces) {
      const std::size_t end = start + piece.bytes;
      if (offset < end) {
        const std::size_t skip = offset - start;
        const std::size_t n =
            ring.put(static_cast<const std::byte*>(piece.data) + skip, piece.bytes - skip);
        offset += n;
        if (offset < end) return offset;  // the ring is full
      }
      start = end;
    }
    return offset;
  }

  // The stream's bytes from `offset` on, copied.
  std::vector<std::byte> copy_from(std::size_t offset) const {
    std::vector<std::byte> bytes(total - offset);
    std::size_t start = 0;
    std::byte* out = bytes.data();
    for (const ShmPart& piece : pieces) {
      const std::size_t end = start + piece.bytes;
      if (offset < end) {
        const std::size_t skip = std::max(offset, start) - start;
        std::memcpy(out, static_cast<const std::byte*>(piece.data) + skip, piece.bytes - skip);
        out += piece.bytes - skip;
      }
      start = end;
    }
    return bytes;
  }
};

}  // namespace

// -- ShmMessage -------------------------------------------------------------------------------

ShmMessage::ShmMessage(std::uint64_t tag, std::size_t bytes, bool poison)
    : tag_(tag),
      size_(bytes),
      data_(static_cast<std::byte*>(::operator new(std::max<std::size_t>(bytes, 1), kMessageAlign))),
      poison_(poison) {}

ShmMessage::~ShmMessage() {
  if (poison_) std::memset(data_, 0xFF, size_);
  ::operator delete(data_, kMessageAlign);
}

// -- ShmSender --------------------------------------------------------------------------------

ShmSender::ShmSender(const std::string& name, double timeout_s, std::chrono::nanoseconds spin)
    : ring_(ShmRing::attach(name, timeout_s, spin)) {}

ShmSender::~ShmSender() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ring_->close("the sender closed its channel", false);  // wakes a flusher waiting for room
  changed_.notify_all();
  if (flusher_.joinable()) flusher_.join();
}

bool ShmSender::send(std::uint64_t tag, const std::vector<ShmPart>& parts) {
  const Stream stream(tag, parts);
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) throw_failure();
  ring_->throw_if_closed("sending");
  std::size_t written = 0;
  if (queue_.empty()) {  // else the flusher owns the ring's write side, and order is kept
    written = stream.put(*ring_, 0);
    if (written > 0) ring_->publish();
    if (written == stream.total) return true;
  }
  queue_.push_back(Pending{stream.copy_from(written), 0});
  queued_bytes_ += stream.total - written;
  if (!flusher_.joinable()) flusher_ = std::thread([this] { flush_queue(); });
  changed_.notify_all();
  return false;
}

void ShmSender::flush_queue() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [this] { return stopping_ || error_ || !queue_.empty(); });
    if (stopping_ || error_) {
      fail(error_.value_or("the sender closed its channel"));
      return;
    }
    // The front stays queued while it is written, so that send() queues behind it; deque
    // references survive the push_backs of other threads meanwhile.
    Pending& front = queue_.front();
    lock.unlock();
    try {
      while (front.written < front.bytes.size()) {
        ring_->throw_if_closed("flushing the queue");
        const std::size_t n =
            ring_->put(front.bytes.data() + front.written, front.bytes.size() - front.written);
        if (n > 0) {
          front.written += n;
          ring_->publish();
        } else {
          ring_->wait_for_room(ShmRing::Clock::now() + kFlusherSlice);
        }
      }
    } catch (const std::exception& error) {
      lock.lock();
      fail(error.what());
      return;
    }
    lock.lock();
    queued_bytes_ -= front.bytes.size();
    queue_.pop_front();
    changed_.notify_all();
  }
}

void ShmSender::fail(const std::string& error) {
  if (!error_) error_ = error;
  queue_.clear();
  queued_bytes_ = 0;
  changed_.notify_all();
}

void ShmSender::throw_failure() const { throw ChannelClosed(*error_); }

void ShmSender::flush(double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool settled = changed_.wait_until(lock, ShmRing::deadline_in(timeout_s),
                                           [this] { return queue_.empty() || error_; });
  if (error_) throw_failure();
  if (!settled) {
    throw WaitTimeout("gpipe_fast: " + std::to_string(queued_bytes_) + " bytes for shared-memory "
                      "channel '" + name() + "' still queued after " +
                      std::to_string(timeout_s) + " s (the receiver has not read them)");
  }
}

void ShmSender::close(const std::string& reason, bool failed) {
  ring_->close(reason, failed);
  std::lock_guard<std::mutex> lock(mutex_);
  // A flusher writing the front meets the closed ring and drops the queue itself; an idle one
  // (the queue is empty then) wakes and ends.
  if (!error_) {
    error_ = "gpipe_fast: shared-memory channel '" + name() + "' was closed by this process: " +
             reason;
  }
  changed_.notify_all();
}

std::size_t ShmSender::queued_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queued_bytes_;
}

// -- ShmReceiver ------------------------------------------------------------------------------

ShmReceiver::ShmReceiver(const std::string& name, std::size_t ring_bytes,
                         std::chrono::nanoseconds spin, bool poison)
    : ring_(ShmRing::create(name, ring_bytes, spin)), poison_(poison) {
  ring_->set_poison(poison);
}

ShmReceiver::~ShmReceiver() { ring_->close("the receiver closed its channel", false); }

void ShmReceiver::wait_attached(double timeout_s) { ring_->wait_attached(timeout_s); }

std::shared_ptr<ShmMessage> ShmReceiver::receive(std::uint64_t tag, double timeout_s) {
  std::lock_guard<std::mutex> receiving(receiving_);
  {
    std::lock_guard<std::mutex> lock(aside_mutex_);
    auto kept = aside_.find(tag);
    if (kept != aside_.end()) {
      auto message = std::move(kept->second.front());
      kept->second.pop_front();
      if (kept->second.empty()) aside_.erase(kept);
      --aside_count_;
      return message;
    }
  }
  const auto deadline = ShmRing::deadline_in(timeout_s);
  for (;;) {
    auto message = next_message(deadline);
    if (!message) {
      throw WaitTimeout("gpipe_fast: no message tagged " + std::to_string(tag) +
                        " on shared-memory channel '" + name() + "' within " +
                        std::to_string(timeout_s) + " s");
    }
    if (message->tag() == tag) return message;
    std::lock_guard<std::mutex> lock(aside_mutex_);
    aside_[message->tag()].push_back(std::move(message));
    ++aside_count_;
  }
}

std::shared_ptr<ShmMessage> ShmReceiver::next_message(ShmRing::Clock::time_point deadline) {
  if (!incoming_) {
    if (!ring_->wait_for_bytes(sizeof(Frame), deadline)) return nullptr;
    Frame frame{};
    ring_->take(&frame, sizeof(Frame));
    ring_->release();
    if (frame.bytes > kMaxMessageBytes || frame.bytes % kShmPartAlign != 0) {
      ring_->close("a corrupt frame", true);
      throw ChannelClosed("gpipe_fast: shared-memory channel '" + name() +
                          "' holds a frame of " + std::to_string(frame.bytes) +
                          " bytes: its memory was overwritten");
    }
    incoming_ = Incoming{std::make_shared<ShmMessage>(frame.tag, frame.bytes, poison_), 0};
  }
  Incoming& incoming = *incoming_;
  const std::size_t size = incoming.message->size();
  while (incoming.received < size) {
    const std::size_t n =
        ring_->take(incoming.message->data() + incoming.received, size - incoming.received);
    if (n > 0) {
      incoming.received += n;
      ring_->release();
    } else if (!ring_->wait_for_bytes(1, deadline)) {
      return nullptr;
    }
  }
  auto message = std::move(incoming.message);
  incoming_.reset();
  return message;
}

void ShmReceiver::close(const std::string& reason, bool failed) { ring_->close(reason, failed); }

std::size_t ShmReceiver::set_aside() const {
  std::lock_guard<std::mutex> lock(aside_mutex_);
  return aside_count_;
}

}  // namespace gpipe_fast
