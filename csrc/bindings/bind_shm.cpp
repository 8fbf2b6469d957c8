// Bindings for the same-host shared-memory channel (ShmSender, ShmReceiver, ShmMessage).
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/shm_channel.hpp"

namespace py = pybind11;

namespace gpipe_fast::bindings {
namespace {

std::chrono::nanoseconds spin_of(double spin_us) {
  GF_EXPECTS(spin_us >= 0.0, "spin_us must be >= 0");
  return std::chrono::nanoseconds(static_cast<std::int64_t>(spin_us * 1000.0));
}

}  // namespace

void bind_shm(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const WaitTimeout& timeout) {
      PyErr_SetString(PyExc_TimeoutError, timeout.what());
    } catch (const ChannelClosed& closed) {
      PyErr_SetString(PyExc_ConnectionError, closed.what());
    }
  });
  m.attr("SHM_PART_ALIGN") = kShmPartAlign;

  py::class_<ShmMessage, std::shared_ptr<ShmMessage>>(
      m, "ShmMessage", py::buffer_protocol(),
      "A received message: its tag, and its bytes through the buffer protocol (writable, "
      "64-byte aligned; torch.frombuffer views them without a copy).")
      .def_property_readonly("tag", &ShmMessage::tag)
      .def_property_readonly("nbytes", &ShmMessage::size)
      .def("__len__", &ShmMessage::size)
      .def_buffer([](ShmMessage& message) {
        return py::buffer_info(message.data(), 1, py::format_descriptor<std::uint8_t>::format(),
                               1, {static_cast<py::ssize_t>(message.size())}, {1}, false);
      });

  py::class_<ShmSender>(
      m, "ShmSender",
      "The sending end of a shared-memory ring that a ShmReceiver created. send() never "
      "waits for the receiver; what does not fit is copied and queued for a flusher thread.")
      .def(py::init([](const std::string& name, double timeout_s, double spin_us) {
             return std::make_unique<ShmSender>(name, timeout_s, spin_of(spin_us));
           }),
           py::arg("name"), py::arg("timeout_s"), py::arg("spin_us") = 20.0,
           py::call_guard<py::gil_scoped_release>(),
           "Attaches to ring `name`, waiting up to timeout_s for its receiver to create it "
           "(TimeoutError), then removes the name from /dev/shm.")
      .def(
          "send",
          [](ShmSender& sender, std::uint64_t tag,
             const std::vector<std::pair<std::uintptr_t, std::size_t>>& parts) {
            std::vector<ShmPart> gathered;
            gathered.reserve(parts.size());
            for (const auto& [address, bytes] : parts) {
              gathered.push_back({reinterpret_cast<const void*>(address), bytes});
            }
            py::gil_scoped_release nogil;
            return sender.send(tag, gathered);
          },
          py::arg("tag"), py::arg("parts"),
          "Sends the (address, nbytes) parts as one message tagged `tag`, each part at an offset "
          "aligned to SHM_PART_ALIGN. True when it went into the ring whole, False when (part "
          "of) it was copied and queued. ConnectionError when the channel is closed.")
      .def("flush", &ShmSender::flush, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>(),
           "Waits until everything queued is in the ring: TimeoutError after timeout_s, "
           "ConnectionError when the receiver closed the ring or died.")
      .def("close", &ShmSender::close, py::arg("reason") = "", py::arg("failed") = false,
           py::call_guard<py::gil_scoped_release>(),
           "Closes the ring for both sides (failed: this rank's step failed) and drops the "
           "queue; the receiver still reads what the ring holds.")
      .def_property_readonly("queued_bytes", &ShmSender::queued_bytes)
      .def_property_readonly("name", &ShmSender::name);

  py::class_<ShmReceiver>(
      m, "ShmReceiver",
      "The receiving end of a shared-memory ring, which it creates. receive(tag) hands out "
      "the message with that tag, keeping others aside until asked for.")
      .def(py::init([](const std::string& name, std::size_t ring_bytes, double spin_us,
                       bool poison) {
             return std::make_unique<ShmReceiver>(name, ring_bytes, spin_of(spin_us), poison);
           }),
           py::arg("name"), py::arg("ring_bytes") = std::size_t{1} << 21,
           py::arg("spin_us") = 20.0, py::arg("poison") = false,
           "Creates ring `name` ('/...', unique per job) with ring_bytes of room (a power of "
           "two, at least 4096). poison: a debug mode that overwrites every consumed ring byte, "
           "and a message's bytes once it goes, with 0xFF.")
      .def("wait_attached", &ShmReceiver::wait_attached, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>(),
           "Waits until the sender attached (TimeoutError after timeout_s); the name is "
           "removed from /dev/shm then.")
      .def("receive", &ShmReceiver::receive, py::arg("tag"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>(),
           "The next message tagged `tag`. TimeoutError when none completed within timeout_s "
           "(nothing is lost: call again); ConnectionError when the sender closed the ring or "
           "died first.")
      .def("close", &ShmReceiver::close, py::arg("reason") = "", py::arg("failed") = false,
           py::call_guard<py::gil_scoped_release>(),
           "Closes the ring for both sides (failed: this rank's step failed).")
      .def_property_readonly("set_aside", &ShmReceiver::set_aside,
                             "Messages received with another tag and not yet asked for.")
      .def_property_readonly("name", &ShmReceiver::name);
}

}  // namespace gpipe_fast::bindings
