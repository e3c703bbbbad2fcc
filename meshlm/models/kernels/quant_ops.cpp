// quant_rows.cpp's products as PyTorch operators registered from C++: the CPU kernels of `meshlm::int8_rows` and
// `meshlm::int4_rows`, whose schemas and shape functions models/native.py defines in Python. models/native.py
// builds this file together with quant_rows.cpp, against the installed PyTorch's headers and libraries, and loads
// the result with `torch.ops.load_library`. A call from a compiled step then goes from the dispatcher straight into
// C++ (about 2.5 µs a call on a 2-core AMD EPYC) instead of through a Python function and ctypes (about 11 µs):
// SmolLM2 makes 120 such calls a decoded token (benchmarks/RESULTS.md, "The quantized rows as C++ operators").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)

extern "C" int meshlm_int8_rows(const float* x, const int8_t* q, const void* s, int s_dtype, float* y, int64_t R,
                                int64_t K, int64_t N, int threads);
extern "C" int meshlm_int4_rows(const float* x, const uint8_t* p, const void* sz, int sz_dtype, float* y, int64_t R,
                                int64_t K, int64_t N, int64_t group, int threads);

namespace {

int scale_dtype(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "meshlm::", name,
                ": scales must be float32 or bfloat16, not ", t.scalar_type());
    return t.scalar_type() == at::kFloat ? 0 : 1;
}

void check_rows(const at::Tensor& x, const char* name) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) > 0 &&
                    x.size(1) % 32 == 0,
                "meshlm::", name, ": x must be a non-empty (rows, K) float32 CPU tensor with K a multiple of 32, got ",
                x.sizes(), " ", x.scalar_type());
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s) {
    check_rows(x, "int8_rows");
    const int64_t R = x.size(0), K = x.size(1), N = q.size(0);
    TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(1) == K && q.is_contiguous(),
                "meshlm::int8_rows: q must be contiguous (N, ", K, ") int8, got ", q.sizes(), " ", q.scalar_type());
    TORCH_CHECK(s.numel() == N && s.is_contiguous(), "meshlm::int8_rows: s must hold ", N, " contiguous scales");
    const int dtype = scale_dtype(s, "int8_rows");
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({R, N}, x.options());
    const int rc = meshlm_int8_rows(xc.data_ptr<float>(), q.data_ptr<int8_t>(), s.data_ptr(), dtype,
                                    y.data_ptr<float>(), R, K, N, at::get_num_threads());
    TORCH_CHECK(rc == 0, "meshlm::int8_rows refused its arguments (", rc, ")");
    return y;
}

at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group) {
    check_rows(x, "int4_rows");
    const int64_t R = x.size(0), K = x.size(1), N = packed.size(0);
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(1) * 2 == K &&
                    packed.is_contiguous(),
                "meshlm::int4_rows: packed must be contiguous (N, ", K / 2, ") uint8, got ", packed.sizes());
    TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0, "meshlm::int4_rows: group ", group,
                " must be a multiple of 32 that divides K = ", K);
    TORCH_CHECK(sz.dim() == 3 && sz.size(0) == N && sz.size(1) == K / group && sz.size(2) == 2 && sz.is_contiguous(),
                "meshlm::int4_rows: scales_and_zeros must be contiguous (", N, ", ", K / group, ", 2), got ",
                sz.sizes());
    const int dtype = scale_dtype(sz, "int4_rows");
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({R, N}, x.options());
    const int rc = meshlm_int4_rows(xc.data_ptr<float>(), packed.data_ptr<uint8_t>(), sz.data_ptr(), dtype,
                                    y.data_ptr<float>(), R, K, N, group, at::get_num_threads());
    TORCH_CHECK(rc == 0, "meshlm::int4_rows refused its arguments (", rc, ")");
    return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(meshlm, CPU, m) {
    m.impl("int8_rows", &int8_rows);
    m.impl("int4_rows", &int4_rows);
}

#endif
