// The kernels' entry points (ops.h) bound with pybind11, for eager calls from Python
// (`tokenmill.model.kernels.ops`); compiled graphs call the same functions as torch.ops.tokenmill.*.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &tokenmill::int8_linear);
  m.def("int4_rows_linear", &tokenmill::int4_rows_linear);
  m.def("int4_linear", &tokenmill::int4_linear);
  m.def("quant_tiles_linear", &tokenmill::quant_tiles_linear);
  m.def("dense_linear", &tokenmill::dense_linear);
  m.def("rms_norm", &tokenmill::rms_norm);
  m.def("rotary", &tokenmill::rotary);
  m.def("rotary_write_kv", &tokenmill::rotary_write_kv);
  m.def("gated_activation", &tokenmill::gated_activation);
  m.def("decode_attention", &tokenmill::decode_attention);
  m.def("greedy_ids", &tokenmill::greedy_ids);
  m.def("sample_ids", &tokenmill::sample_ids);
  m.def("ban_disallowed_", &tokenmill::ban_disallowed_);
}
