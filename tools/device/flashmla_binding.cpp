// The module `flash_mla.cuda` with FlashMLA's dense MLA decode alone (sm90a), for tools/device/build_flashmla.sh.
// FlashMLA's own csrc/api/api.cpp also binds the sparse and sm100 kernels, which take long to build and which
// plugserve does not use; `flash_mla.flash_mla_with_kvcache` needs only `dense_decode_fwd` for dense caches.
#include <pybind11/pybind11.h>

#include "api/dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA dense MLA decode (sm90a), built by plugserve's tools/device/build_flashmla.sh";
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
