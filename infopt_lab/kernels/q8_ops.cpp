// The products of q8_dot.c registered with PyTorch's dispatcher as C++ kernels: infopt::q4_linear_native and
// infopt::q8w_linear_native; and attention.c's one-query attention over a static cache (compiled.py's
// StaticLayer), infopt::one_query_attention.
//
// A compiled decode step calls the quantized product about a hundred and twenty times. Registered from Python
// (cpu_q8.py's infopt::q4_linear and infopt::q8w_linear), each call crosses from the dispatcher back into the
// interpreter, checks its operands there and calls the kernel through ctypes: tens of microseconds, about as
// long as the product of a small layer itself. Registered here, the dispatcher calls the kernel directly.
// cpu_q8.py builds this file with the library of q8_dot.c linked in, loads it with torch.ops.load_library and
// falls back to the Python registration where it does not build. The checks are those of cpu_q8._call, and
// the shapes too: the kernel reads raw memory, so nothing reaches it in a layout it does not expect.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

extern "C" {
int q4_linear(const float *x, int64_t rows, int64_t K, const uint8_t *w, const float *scales,
              const uint8_t *zeros, int64_t N, int64_t G, float *y, int nthreads);
int q8w_linear(const float *x, int64_t rows, int64_t K, const int8_t *w, const float *scales, int64_t N,
               float *y, int nthreads);
void one_query_attention(const float *q, const float *k, const float *v, int64_t B, int64_t H, int64_t Hkv,
                         int64_t S, int64_t D, int64_t n, float scale, float *scores, float *out, int nthreads);
}

namespace {

constexpr int64_t kBlock = 32;  // activations per quantization block (QB in q8_dot.c)

void check_operand(const char *op, const at::Tensor &t, at::ScalarType dtype, const char *name) {
  TORCH_CHECK_VALUE(t.is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), op,
                    " takes contiguous CPU operands of dtype ", name, ", got ", t.scalar_type(), " on ",
                    t.device(), t.is_contiguous() ? " (contiguous)" : " (not contiguous)");
}

// x [rows, K] on the CPU, as fp32 and contiguous (a copy only where it is not already).
at::Tensor activations(const char *op, const at::Tensor &x, int64_t K) {
  TORCH_CHECK_VALUE(x.is_cpu(), op, " takes activations on the CPU, got them on ", x.device());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == K, op, " takes activations [rows, ", K, "], got ", x.sizes());
  return x.to(at::kFloat).contiguous();  // a no-op on fp32 contiguous activations
}

at::Tensor q8w_linear_native(const at::Tensor &x, const at::Tensor &weight_q, const at::Tensor &scales) {
  const char *op = "q8w_linear";
  check_operand(op, weight_q, at::kChar, "torch.int8");
  check_operand(op, scales, at::kFloat, "torch.float32");
  TORCH_CHECK_VALUE(weight_q.dim() == 2 && weight_q.size(1) % kBlock == 0, op,
                    " takes an int8 weight [N, K] with K a multiple of 32, got ", weight_q.sizes());
  const int64_t N = weight_q.size(0), K = weight_q.size(1);
  TORCH_CHECK_VALUE(scales.numel() == N, op, " takes one scale per output row (", N, "), got ", scales.sizes());
  const at::Tensor a = activations(op, x, K);
  at::Tensor y = at::empty({a.size(0), N}, a.options());  // (rows, N)
  if (a.size(0) == 0) return y;
  TORCH_CHECK(!q8w_linear(a.const_data_ptr<float>(), a.size(0), K, weight_q.const_data_ptr<int8_t>(),
                          scales.const_data_ptr<float>(), N, y.mutable_data_ptr<float>(), at::get_num_threads()),
              op, ": no memory for the quantized activations of ", a.size(0), " rows");
  return y;
}

at::Tensor q4_linear_native(const at::Tensor &x, const at::Tensor &weight_q, const at::Tensor &scales,
                            const at::Tensor &zeros, int64_t group_size) {
  const char *op = "q4_linear";
  check_operand(op, weight_q, at::kByte, "torch.uint8");
  check_operand(op, scales, at::kFloat, "torch.float32");
  check_operand(op, zeros, at::kByte, "torch.uint8");
  TORCH_CHECK_VALUE(weight_q.dim() == 2 && (2 * weight_q.size(1)) % (2 * kBlock) == 0, op,
                    " takes a packed int4 weight [N, K/2] with K a multiple of 64, got ", weight_q.sizes());
  const int64_t N = weight_q.size(0), K = 2 * weight_q.size(1);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0, op,
                    " takes a group size that is a multiple of 32 dividing ", K, ", got ", group_size);
  const int64_t groups = K / group_size;
  TORCH_CHECK_VALUE(scales.numel() == N * groups && zeros.numel() == N * groups, op, " takes scales and zeros [",
                    N, ", ", groups, "], got ", scales.sizes(), " and ", zeros.sizes());
  const at::Tensor a = activations(op, x, K);
  at::Tensor y = at::empty({a.size(0), N}, a.options());  // (rows, N)
  if (a.size(0) == 0) return y;
  TORCH_CHECK(!q4_linear(a.const_data_ptr<float>(), a.size(0), K, weight_q.const_data_ptr<uint8_t>(),
                         scales.const_data_ptr<float>(), zeros.const_data_ptr<uint8_t>(), N, group_size,
                         y.mutable_data_ptr<float>(), at::get_num_threads()),
              op, ": no memory for the quantized activations of ", a.size(0), " rows");
  return y;
}

// q [B, H, 1, D] at position input_pos (one int64) against the cache k, v [B, H_kv, S, D], which already holds
// it: positions 0 .. input_pos visible. fp32 only (compiled.py keeps its own lowering for other dtypes).
at::Tensor one_query_attention_native(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                      const at::Tensor &input_pos) {
  const char *op = "one_query_attention";
  for (const at::Tensor *t : {&q, &k, &v})
    TORCH_CHECK_VALUE(t->is_cpu() && t->scalar_type() == at::kFloat, op, " takes fp32 CPU q, k and v, got ",
                      t->scalar_type(), " on ", t->device());
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(2) == 1, op, " takes one query per head, q [B, H, 1, D], got ",
                    q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4 && k.sizes() == v.sizes(), op,
                    " takes k and v [B, H_kv, S, D] of one shape, got ", k.sizes(), " and ", v.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(3) == D && Hkv > 0 && H % Hkv == 0, op,
                    " takes q [B, H, 1, D] and k [B, H_kv, S, D] with H a multiple of H_kv, got ", q.sizes(),
                    " and ", k.sizes());
  TORCH_CHECK_VALUE(input_pos.is_cpu() && input_pos.numel() == 1 && input_pos.scalar_type() == at::kLong, op,
                    " takes one int64 position on the CPU, got ", input_pos.scalar_type(), " ", input_pos.sizes());
  const int64_t pos = *input_pos.const_data_ptr<int64_t>();  // read in place: item() is a dispatched call
  TORCH_CHECK_VALUE(0 <= pos && pos < S, op, ": position ", pos, " is outside the cache's ", S, " positions");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty({B, H, 1, D}, qc.options());
  if (B * H * D == 0) return out;
  at::Tensor scores = at::empty({B * H * (pos + 1)}, qc.options());
  ::one_query_attention(qc.const_data_ptr<float>(), kc.const_data_ptr<float>(), vc.const_data_ptr<float>(), B, H,
                        Hkv, S, D, pos + 1, 1.0f / std::sqrt(static_cast<float>(D)),
                        scores.mutable_data_ptr<float>(), out.mutable_data_ptr<float>(), at::get_num_threads());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infopt, m) {
  m.def("q4_linear_native(Tensor x, Tensor weight_q, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("q8w_linear_native(Tensor x, Tensor weight_q, Tensor scales) -> Tensor");
  m.def("one_query_attention(Tensor q, Tensor k, Tensor v, Tensor input_pos) -> Tensor");
}

TORCH_LIBRARY_IMPL(infopt, CPU, m) {
  m.impl("q4_linear_native", &q4_linear_native);
  m.impl("q8w_linear_native", &q8w_linear_native);
  m.impl("one_query_attention", &one_query_attention_native);
}
