// paged_decode.cpp's attention as a PyTorch operator registered from C++: the CPU kernel of `meshlm::row_decode`,
// whose schema, shape function and Python kernel models/paged.py defines. models/native.py builds this file together
// with paged_decode.cpp, against the installed PyTorch's headers and libraries, into a library of its own
// (`native.row_ops()`: the plain kernel, loaded with ctypes, stays free of PyTorch's headers) and loads it with
// `torch.ops.load_library`; the kernel registered here for the CPU then takes the place of the Python one, so a
// compiled one-token step goes from the dispatcher straight into C++ for each of its layers' attention.
// MESHLM_CHUNK (models/native.py's CHUNK) comes from the build's flags.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

extern "C" int meshlm_paged_decode(const void* q, int64_t q_row, int64_t q_head, const void* kpool,
                                   const void* vpool, const int64_t* table, int64_t nb, const int64_t* lens,
                                   void* out, float* lse, int64_t R, int64_t nh, int64_t nkv, int64_t hd,
                                   int64_t slots, int64_t bs, float scale, int64_t chunk, int dtype, int threads);

namespace {

at::Tensor row_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                      const at::Tensor& lens, int64_t block_size, double scale) {
    TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
                "meshlm::row_decode: q must be float32 or bfloat16, not ", q.scalar_type());
    TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.stride(3) == 1,
                "meshlm::row_decode: q must be (rows, heads, 1, head_dim) with each head's values contiguous, got ",
                q.sizes(), " strides ", q.strides());
    const int64_t R = q.size(0), nh = q.size(1), hd = q.size(3);
    for (const at::Tensor* pool : {&k, &v})
        TORCH_CHECK(pool->scalar_type() == q.scalar_type() && pool->dim() == 3 && pool->size(2) == hd &&
                        pool->is_contiguous() && pool->sizes() == k.sizes(),
                    "meshlm::row_decode: k and v must be contiguous (kv_heads, slots, ", hd, ") ", q.scalar_type(),
                    " pools of one shape, got ", pool->sizes(), " ", pool->scalar_type());
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(0) == R,
                "meshlm::row_decode: table must be (", R, ", blocks) int64, got ", table.sizes(), " ",
                table.scalar_type());
    TORCH_CHECK(lens.scalar_type() == at::kLong && lens.numel() == R,
                "meshlm::row_decode: lens must hold ", R, " int64 lengths, got ", lens.sizes(), " ", lens.scalar_type());
    TORCH_CHECK(block_size > 0, "meshlm::row_decode: block_size must be positive, got ", block_size);
    TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && table.device().is_cpu() &&
                    lens.device().is_cpu(),
                "meshlm::row_decode: every tensor must be on the CPU");
    const at::Tensor tc = table.contiguous(), lc = lens.contiguous();
    at::Tensor out = at::empty({R, nh, 1, hd}, q.options());
    const int rc = meshlm_paged_decode(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
                                       tc.data_ptr<int64_t>(), tc.size(1), lc.data_ptr<int64_t>(), out.data_ptr(),
                                       nullptr, R, nh, k.size(0), hd, k.size(1), block_size,
                                       static_cast<float>(scale), MESHLM_CHUNK, q.scalar_type() == at::kFloat ? 0 : 1,
                                       at::get_num_threads());
    TORCH_CHECK(rc == 0, "meshlm::row_decode: ", nh, " query heads over ", k.size(0), " KV heads of width ", hd,
                " are outside the kernel's limits (", rc, ")");
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(meshlm, CPU, m) { m.impl("row_decode", &row_decode); }
