// Python bindings of the CUTLASS block-FP8 GEMM (fp8_blockwise_gemm.cuh): operand checks, then one of the
// two tile configurations, chosen by the caller. Both write out[M, N] in place on the current stream.
#include <torch/extension.h>

namespace plugserve::cutlass_fp8 {

void gemm_64x128(at::Tensor const& a, at::Tensor const& a_scales, at::Tensor const& b, at::Tensor const& b_scales,
                 at::Tensor& out);
void gemm_128x128(at::Tensor const& a, at::Tensor const& a_scales, at::Tensor const& b, at::Tensor const& b_scales,
                  at::Tensor& out);

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_operands(at::Tensor const& a, at::Tensor const& a_scales, at::Tensor const& b, at::Tensor const& b_scales,
                    at::Tensor const& out) {
  TORCH_CHECK(a.is_cuda() && a_scales.device() == a.device() && b.device() == a.device() &&
                  b_scales.device() == a.device() && out.device() == a.device(),
              "all operands must be on one CUDA device");
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat8_e4m3fn && a.is_contiguous(),
              "a must be a contiguous float8_e4m3fn [M, K] tensor, got ", a.scalar_type(), " ", a.sizes());
  TORCH_CHECK(b.dim() == 2 && b.scalar_type() == at::kFloat8_e4m3fn && b.is_contiguous() && b.size(1) == a.size(1),
              "b must be a contiguous float8_e4m3fn [N, K=", a.size(1), "] tensor, got ", b.scalar_type(), " ",
              b.sizes());
  int64_t const m = a.size(0), k = a.size(1), n = b.size(0);
  TORCH_CHECK(m > 0 && k % 16 == 0 && n % 8 == 0,
              "needs M > 0, K a multiple of 16 and N of 8 (16-byte rows for TMA), got M=", m, ", N=", n, ", K=", k);
  TORCH_CHECK(a_scales.scalar_type() == at::kFloat && a_scales.dim() == 2 && a_scales.size(0) == m &&
                  a_scales.size(1) == ceil_div(k, 128) && a_scales.stride(0) == 1 && a_scales.stride(1) >= m &&
                  a_scales.stride(1) % 4 == 0,
              "a_scales must be float32 [M=", m, ", K/128=", ceil_div(k, 128),
              "] with strides (1, ld), ld >= M a multiple of 4; got ", a_scales.scalar_type(), " ", a_scales.sizes(),
              " strides ", a_scales.strides());
  TORCH_CHECK(b_scales.scalar_type() == at::kFloat && b_scales.is_contiguous() && b_scales.dim() == 2 &&
                  b_scales.size(0) == ceil_div(n, 128) && b_scales.size(1) == ceil_div(k, 128),
              "b_scales must be contiguous float32 [N/128=", ceil_div(n, 128), ", K/128=", ceil_div(k, 128), "], got ",
              b_scales.scalar_type(), " ", b_scales.sizes());
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == m &&
                  out.size(1) == n,
              "out must be a contiguous bfloat16 [M=", m, ", N=", n, "] tensor, got ", out.scalar_type(), " ",
              out.sizes());
}

template <void (*gemm)(at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor&)>
void checked(at::Tensor const& a, at::Tensor const& a_scales, at::Tensor const& b, at::Tensor const& b_scales,
             at::Tensor out) {
  check_operands(a, a_scales, b, b_scales, out);
  gemm(a, a_scales, b, b_scales, out);
}

}  // namespace
}  // namespace plugserve::cutlass_fp8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using namespace plugserve::cutlass_fp8;
  char const* doc = "(a [M,K] e4m3, a_scales [M,K/128] fp32 M-major, b [N,K] e4m3, b_scales [N/128,K/128] fp32, "
                    "out [M,N] bf16): out = block-scaled a @ b^T";
  module.def("gemm_64x128", &checked<gemm_64x128>, doc);
  module.def("gemm_128x128", &checked<gemm_128x128>, doc);
}
