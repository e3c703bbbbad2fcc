// bf16_rows.cpp's product as a PyTorch operator registered from C++: the CPU kernel of `meshlm::bf16_rows`, whose
// schema and shape function models/native.py defines in Python. models/native.py builds this file together with
// bf16_rows.cpp, against the installed PyTorch's headers and libraries, and loads the result with
// `torch.ops.load_library`, as it does quant_ops.cpp: a compiled step calls it with no Python in between.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)

extern "C" int meshlm_bf16_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t R, int64_t K,
                                int64_t N, int threads);

namespace {

// x (R, K) bf16 (rows read in place where each is contiguous); w (N, K) bf16 contiguous → x wᵀ (R, N) in bf16 (sums
// in fp32, rounded once).
at::Tensor bf16_rows(const at::Tensor& x, const at::Tensor& w) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) > 0 &&
                    x.size(1) > 0,
                "meshlm::bf16_rows: x must be a non-empty (rows, K) bfloat16 CPU tensor, got ", x.sizes(), " ",
                x.scalar_type());
    const int64_t R = x.size(0), K = x.size(1);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) == K &&
                    w.size(0) > 0 && w.is_contiguous(),
                "meshlm::bf16_rows: w must be a contiguous (N, ", K, ") bfloat16 CPU tensor, got ", w.sizes(), " ",
                w.scalar_type());
    const at::Tensor xc = x.stride(1) == 1 && (R == 1 || x.stride(0) >= K) ? x : x.contiguous();
    const int64_t N = w.size(0);
    at::Tensor y = at::empty({R, N}, x.options());
    const int rc = meshlm_bf16_rows(static_cast<const uint16_t*>(xc.data_ptr()), R == 1 ? K : xc.stride(0),
                                    static_cast<const uint16_t*>(w.data_ptr()), static_cast<uint16_t*>(y.data_ptr()),
                                    R, K, N, at::get_num_threads());
    TORCH_CHECK(rc == 0, "meshlm::bf16_rows refused its arguments (", rc, ")");
    return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(meshlm, CPU, m) { m.impl("bf16_rows", &bf16_rows); }

#endif
