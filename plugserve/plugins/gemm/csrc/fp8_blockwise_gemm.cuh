// plugserve's CUTLASS block-scaled FP8 GEMM for sm90a (Hopper), built from CUTLASS >= 3.9 headers.
//
//   out[M, N] (bf16) = sum over K blocks kb of (a[:, kb] x b[:, kb]^T) * a_scales[m, kb] * b_scales[n / 128, kb]
//
// a        [M, K] float8_e4m3fn, row-major (K contiguous): the activations, quantized per 1 x 128 group
// a_scales [M, K/128] float32, M-major: element (m, kb) at m + kb * ld, ld = round_up(M, 4) (16-byte
//          aligned columns, what the scales' TMA load needs); rows M..ld-1 of the buffer are never
//          trusted: they only ever scale accumulator rows at or beyond M, which are not stored
// b        [N, K] float8_e4m3fn, row-major: the weight, i.e. a column-major K x N operand B
// b_scales [N/128, K/128] float32, row-major (the checkpoint's weight_scale_inv as it is)
// M is anything; N a multiple of 8 and K of 16 (16-byte rows for TMA); edges past M, N, K are
// zero-filled by TMA on load and clipped on store. Accumulation in float32, the scales applied every
// 128-wide K block (CUTLASS's "FP8 blockwise" mainloop: KernelTmaWarpSpecialized*FP8Blockwise).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

namespace plugserve::cutlass_fp8 {

using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using ElementAccumulator = float;  // also the scales' type: the blockwise mainloop requires it
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignmentAB = 16;  // elements per 16-byte TMA access
constexpr int kAlignmentD = 8;

// 1 x 128 activation groups with M-major scales, 128 x 128 weight blocks with K-major scales.
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// Decode-sized M: 64-row tiles, two consumer warp groups on alternate tiles (ping-pong).
struct Sm90Pingpong64x128 {
  using TileShape = cute::Shape<cute::_64, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
};

// Prefill-sized M: 128 x 128 tiles, both consumer warp groups on one tile; pairs of CTAs along N share
// the A tile by TMA multicast.
struct Sm90Cooperative128x128 {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

template <class Config>
struct BlockwiseGemm {
  // C is void: no source operand, D = accumulator (alpha 1, beta 0) converted to bf16.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
      void, LayoutD, kAlignmentD, ElementD, LayoutD, kAlignmentD,
      typename Config::EpilogueSchedule>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, cute::tuple<LayoutA, LayoutSFA>, kAlignmentAB,
      ElementB, cute::tuple<LayoutB, LayoutSFB>, kAlignmentAB,
      ElementAccumulator, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

inline void check_status(cutlass::Status status, char const* step, int m, int n, int k) {
  TORCH_CHECK(status == cutlass::Status::kSuccess, "CUTLASS block-FP8 GEMM ", step, " failed for M=", m, ", N=", n,
              ", K=", k, ": ", cutlassGetStatusString(status));
}

// The kernel's arguments for contiguous a [m, k], b [n, k], out [m, n] and a_scales with column stride scale_ld.
template <class Config>
typename BlockwiseGemm<Config>::Gemm::Arguments make_arguments(void const* a, float const* a_scales, int scale_ld,
                                                               void const* b, float const* b_scales, void* out,
                                                               int m, int n, int k, int device, int sm_count) {
  using Gemm = typename BlockwiseGemm<Config>::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;

  StrideA stride_a = cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(m) * k);
  StrideB stride_b = cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(n) * k);
  StrideD stride_d = cute::make_stride(int64_t(n), cute::Int<1>{}, int64_t(m) * n);
  // The activation scales as a [scale_ld, K/128] M-major grid: ScaleConfig's own layout of an
  // M = scale_ld problem (its K-block stride is that M). The weight scales' layout is the problem's.
  LayoutSFA layout_sfa = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(scale_ld, n, k, 1));
  LayoutSFB layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));

  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<ElementA const*>(a), stride_a, static_cast<ElementB const*>(b), stride_b,
       a_scales, layout_sfa, b_scales, layout_sfb},
      {{}, nullptr, stride_d, static_cast<ElementD*>(out), stride_d},
  };
  arguments.hw_info.device_id = device;
  arguments.hw_info.sm_count = sm_count;
  return arguments;
}

// Runs one GEMM on the current stream. The operands were checked by the binding (bindings.cpp).
template <class Config>
void run_blockwise_gemm(at::Tensor const& a, at::Tensor const& a_scales, at::Tensor const& b,
                        at::Tensor const& b_scales, at::Tensor& out) {
  using Gemm = typename BlockwiseGemm<Config>::Gemm;

  c10::cuda::CUDAGuard guard(a.device());
  int const device = a.get_device();
  int const m = static_cast<int>(a.size(0));
  int const k = static_cast<int>(a.size(1));
  int const n = static_cast<int>(b.size(0));
  auto arguments = make_arguments<Config>(
      a.data_ptr(), a_scales.data_ptr<float>(), static_cast<int>(a_scales.stride(1)), b.data_ptr(),
      b_scales.data_ptr<float>(), out.data_ptr(), m, n, k, device,
      cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device));

  Gemm gemm;
  check_status(gemm.can_implement(arguments), "can_implement", m, n, k);
  // Allocated through torch: inside CUDA-graph capture it comes from the graph's pool.
  at::Tensor workspace = at::empty({static_cast<int64_t>(Gemm::get_workspace_size(arguments))},
                                   a.options().dtype(at::kByte));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  check_status(gemm.initialize(arguments, workspace.data_ptr(), stream), "initialize", m, n, k);
  check_status(gemm.run(stream), "launch", m, n, k);
}

}  // namespace plugserve::cutlass_fp8
