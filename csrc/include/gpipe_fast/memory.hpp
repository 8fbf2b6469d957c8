// Memory resources (host, simulated, CUDA) and the recompute pool that sits on top of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpipe_fast/device.hpp"

namespace gpipe_fast {

// Every block a resource hands out is aligned to this many bytes: what cudaMalloc guarantees,
// and enough for any vectorised access a kernel makes to a tensor's storage.
inline constexpr std::size_t kAllocationAlignment = 256;

// Where memory comes from. Callers use the non-virtual allocate()/deallocate(); resources
// implement the private do_allocate()/do_deallocate().
//
// Stream-ordering contract (the same as CUDA's stream-ordered allocator and rmm's):
// - allocate(bytes, s) returns a block that work enqueued on stream s may use at once;
//   another stream may use it only after it has been ordered after that call on s (an event
//   recorded on s and waited on, or a synchronisation).
// - deallocate(p, bytes, s) says that the block's last use is the work enqueued on s so far.
//   The block may be handed out again at once to work on s (the stream runs in order), but to
//   work on another stream only after s's work has finished or the other stream has been
//   ordered after it. Resources that keep freed blocks (RecomputePool) learn that from their
//   caller; the host and simulated resources have no streams to wait for.
// - `bytes` in deallocate must be the `bytes` given to allocate for that block.
// A request for 0 bytes returns nullptr without reaching the resource, and deallocating
// nullptr does nothing. Implementations are thread-safe: every cell's worker allocates.
class MemoryResource {
 public:
  virtual ~MemoryResource() = default;

  // Throws OutOfMemory when the resource cannot provide `bytes`.
  void* allocate(std::size_t bytes, const Stream& stream) {
    return bytes == 0 ? nullptr : do_allocate(bytes, stream);
  }

  // Throws InvalidArgument where the resource can tell that the block is not one it handed
  // out with that size (a double free, a wrong size); the host resource cannot tell.
  void deallocate(void* ptr, std::size_t bytes, const Stream& stream) {
    if (ptr != nullptr) do_deallocate(ptr, bytes, stream);
  }

 private:
  virtual void* do_allocate(std::size_t bytes, const Stream& stream) = 0;
  virtual void do_deallocate(void* ptr, std::size_t bytes, const Stream& stream) = 0;
};

// Host memory from aligned operator new; streams are ignored (the host runs in order).
class HostMemoryResource final : public MemoryResource {
 private:
  void* do_allocate(std::size_t bytes, const Stream& stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, const Stream& stream) override;
};

// Hands out fake, aligned addresses from [base, base + capacity) and never touches them, so
// allocator policy (capacity, fragmentation, reuse) is testable without a GPU. First fit over
// free ranges that are merged again when freed; throws OutOfMemory when no free range fits
// and InvalidArgument on a double free, an unknown address or a wrong size.
class SimulatedMemoryResource final : public MemoryResource {
 public:
  // Far from any real heap or device mapping, so a fake address is easy to recognise.
  static constexpr std::uintptr_t kDefaultBase = std::uintptr_t{1} << 44;

  explicit SimulatedMemoryResource(std::size_t capacity, std::uintptr_t base = kDefaultBase);

  std::size_t capacity() const { return capacity_; }
  // Bytes of the live blocks, each rounded up to kAllocationAlignment.
  std::size_t allocated_bytes() const;
  std::size_t live_blocks() const;

 private:
  void* do_allocate(std::size_t bytes, const Stream& stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, const Stream& stream) override;

  const std::size_t capacity_;
  const std::uintptr_t base_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> free_;  // start address -> length, never adjacent
  std::unordered_map<std::uintptr_t, std::size_t> live_;  // address -> requested bytes
  std::size_t allocated_ = 0;
};

// Device memory on the stream's device: cudaMallocAsync/cudaFreeAsync on the stream when
// `stream_ordered` (the default; needs a GPU with memory pools, any since Pascal on Linux),
// else cudaMalloc/cudaFree. Every call is checked; a failed allocation throws OutOfMemory,
// other failures CudaError. A stream with device < 0 is rejected (InvalidArgument).
// Without a CUDA build the constructor throws CudaError.
class CudaMemoryResource final : public MemoryResource {
 public:
  explicit CudaMemoryResource(bool stream_ordered = true);

  bool stream_ordered() const { return stream_ordered_; }

 private:
  void* do_allocate(std::size_t bytes, const Stream& stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, const Stream& stream) override;

  bool stream_ordered_;
};

// ---- Recompute pool ---------------------------------------------------------------------

// What a RecomputePool holds and has done. Bytes in use count what callers asked for; the
// pool's own rounding to size classes shows in reserved_bytes only.
struct PoolStats {
  std::size_t current_bytes = 0;   // requested bytes of the blocks in use
  std::size_t peak_bytes = 0;      // highest current_bytes since construction or reset_peak()
  std::size_t reserved_bytes = 0;  // bytes of the arenas held from upstream
  std::int64_t arenas = 0;         // arenas held from upstream
  std::int64_t allocations = 0;    // allocate() calls that returned a block
  std::int64_t reuses = 0;         // of those, the ones served by a freed block
};

// A pool for the activations that re-materialisation rebuilds in backward: micro-batch m's
// recompute asks for the same tensor sizes as micro-batch m+1's, and frees them in its
// backward before the next recompute of that cell starts. The pool carves blocks from large
// upstream arenas and keeps freed blocks for the next micro-batch, so after the first
// micro-batch a cell's recompute is served without reaching upstream (no cudaMalloc, no
// fragmentation of the device heap by short-lived activations).
//
// Streams (see MemoryResource): a block freed on stream S goes to S's free list and is reused
// at once by allocations on S. It becomes reusable by other streams of its device only after
// release_stream(S): the caller's statement that S's work so far has finished, or that every
// stream allocating afterwards is ordered after it (the executor's events do that between
// cells). An arena allocated upstream on S is carved only for S until release_stream(S), for
// the same reason. Thread-safe: one mutex guards the bookkeeping (and the rare upstream call).
class RecomputePool final : public MemoryResource {
 public:
  // Large enough that one micro-batch's recompute of a cell fits in one or a few arenas,
  // small against a GPU's memory; to be tuned by measurement on a GPU.
  static constexpr std::size_t kDefaultArenaBytes = std::size_t{32} << 20;

  // arena_bytes: the size of each upstream allocation (a larger request gets an arena of
  // its own); a positive multiple of kAllocationAlignment.
  explicit RecomputePool(std::shared_ptr<MemoryResource> upstream,
                         std::size_t arena_bytes = kDefaultArenaBytes);
  // Returns every arena upstream (blocks still in use become invalid).
  ~RecomputePool() override;
  RecomputePool(const RecomputePool&) = delete;
  RecomputePool& operator=(const RecomputePool&) = delete;

  // The block size a request of `bytes` occupies (see recompute_pool.cpp for the classes).
  static std::size_t size_class(std::size_t bytes);

  // Makes the blocks freed on `stream`, and the arenas allocated on it, available to every
  // stream of its device. Call it once the stream's work so far has finished or will be
  // ordered before any other stream's use (see the class comment).
  void release_stream(const Stream& stream);

  // Returns upstream every arena whose blocks are all free and released, and gives the bytes
  // returned. It frees them on their device's legacy default stream, which is not ordered
  // after other streams' work: call it only when the device work that used the pool's blocks
  // has finished (after a synchronisation, between steps), never inside a step.
  std::size_t trim();

  PoolStats stats() const;
  // Restarts peak_bytes from current_bytes.
  void reset_peak();

  std::size_t arena_bytes() const { return arena_bytes_; }

 private:
  void* do_allocate(std::size_t bytes, const Stream& stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, const Stream& stream) override;

  using StreamKey = std::pair<int, std::uintptr_t>;            // (device, handle)
  using FreeLists = std::map<std::size_t, std::vector<void*>>;  // size class -> blocks

  enum class BlockState : std::uint8_t { InUse, Pending, Released };

  struct Block {
    std::size_t size = 0;       // its size class
    std::size_t requested = 0;  // bytes asked for while in use
    std::uint64_t arena = 0;
    BlockState state = BlockState::InUse;
  };

  struct Arena {
    char* base = nullptr;
    std::size_t size = 0;
    std::size_t carved = 0;  // bytes cut into blocks, from the start
    StreamKey owner;         // the stream it was allocated on
    bool shared = false;     // owner released: carvable for every stream of the device
    std::size_t blocks = 0;
    std::size_t released_blocks = 0;
  };

  static void* pop(FreeLists& lists, std::size_t size);
  void* carve(std::size_t size, const StreamKey& key, const Stream& stream);

  const std::shared_ptr<MemoryResource> upstream_;
  const std::size_t arena_bytes_;

  mutable std::mutex mutex_;
  std::map<std::uint64_t, Arena> arenas_;  // by id, oldest first
  std::uint64_t next_arena_ = 0;
  std::unordered_map<void*, Block> blocks_;  // every carved block, in use or free
  std::map<StreamKey, FreeLists> pending_;   // freed on a stream, not yet released
  std::map<int, FreeLists> released_;        // per device: reusable by any of its streams
  PoolStats stats_;
};

// ---- PyTorch pluggable allocator --------------------------------------------------------

// Names of the extern "C" functions that torch.cuda.memory.CUDAPluggableAllocator loads from
// the gpipe_fast._C module of a CUDA build (csrc/cuda/torch_allocator.cu):
//   void* gpipe_fast_malloc(ssize_t size, int device, cudaStream_t stream);
//   void gpipe_fast_free(void* ptr, ssize_t size, int device, cudaStream_t stream);
inline constexpr char kTorchMallocSymbol[] = "gpipe_fast_malloc";
inline constexpr char kTorchFreeSymbol[] = "gpipe_fast_free";

class PoolRegistry;

// The process-wide pools (over a stream-ordered CudaMemoryResource) behind those functions,
// created on first use with pool 0, the default; nullptr in a build without CUDA.
std::shared_ptr<PoolRegistry> torch_allocator_pools();
// Pool 0 of torch_allocator_pools(); nullptr in a build without CUDA.
std::shared_ptr<RecomputePool> torch_allocator_pool();
// Sends the calling thread's allocations through those functions to pool `id` (0: the
// default) and returns the previous selection; InvalidArgument for an unknown id. Throws
// CudaError in a build without CUDA.
int select_torch_allocator_pool(int id);

}  // namespace gpipe_fast
