// The kernels' entry points (ops.h) bound with pybind11, for eager calls from Python
// (`tokenmill.model.kernels.ops`); compiled graphs call the same functions as torch.ops.tokenmill.*.
// Each call releases the GIL while it runs, as a call through the dispatcher does: the server's
// event loop and the background graph builds run Python meanwhile.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto unlocked = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("int8_linear", &tokenmill::int8_linear, unlocked);
  m.def("int4_rows_linear", &tokenmill::int4_rows_linear, unlocked);
  m.def("int4_linear", &tokenmill::int4_linear, unlocked);
  m.def("quant_tiles_linear", &tokenmill::quant_tiles_linear, unlocked);
  m.def("dense_linear", &tokenmill::dense_linear, unlocked);
  m.def("rms_norm", &tokenmill::rms_norm, unlocked);
  m.def("rotary", &tokenmill::rotary, unlocked);
  m.def("rotary_write_kv", &tokenmill::rotary_write_kv, unlocked);
  m.def("gated_activation", &tokenmill::gated_activation, unlocked);
  m.def("decode_attention", &tokenmill::decode_attention, unlocked);
  m.def("greedy_ids", &tokenmill::greedy_ids, unlocked);
  m.def("sample_ids", &tokenmill::sample_ids, unlocked);
  m.def("ban_disallowed_", &tokenmill::ban_disallowed_, unlocked);
}
