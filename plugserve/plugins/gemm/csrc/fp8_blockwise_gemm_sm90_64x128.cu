// The decode-sized tile configuration, in its own translation unit so that the two compile in parallel.
#include "fp8_blockwise_gemm.cuh"

namespace plugserve::cutlass_fp8 {

void gemm_64x128(at::Tensor const& a, at::Tensor const& a_scales, at::Tensor const& b, at::Tensor const& b_scales,
                 at::Tensor& out) {
  run_blockwise_gemm<Sm90Pingpong64x128>(a, a_scales, b, b_scales, out);
}

}  // namespace plugserve::cutlass_fp8
