// The int8 matrix-vector product of a one-row step: y_o = s_o * sum_i x_i q_oi (docs/engine.md, int8 weights).
//
// x is float32 (rows, K), q int8 (N, K) row-major, s float32 (N,) -> y float32 (rows, N). Each weight is widened
// to float as it is read and multiplied in float32: weight-only int8, as the step's generated loop computes it,
// with another summation order. What makes it faster than that loop: four output rows at a time, each with an
// accumulator of its own (the generated loop has one, and waits on each addition), and the weight rows prefetched
// a few kilobytes ahead of where they are read (a one-row product streams its weights once, and a 576-byte row is
// too short for the hardware prefetcher to ramp up on).
//
// Built by attnkit.engine.native with -march=native: AVX-512 where the CPU has it, else AVX2 with FMA, else plain
// C++. Two entry points: attnkit_int8_matvec (raw pointers, for ctypes) and aoti_torch_cpu_int8_matvec (the C shim
// that AOTInductor's generated code calls for the custom op attnkit::int8_matvec, through
// aot_inductor.custom_ops_to_c_shims).

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdint>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;          // output rows per block, each with its own accumulator
constexpr int64_t kPrefetch = 4096;   // bytes ahead of the read position that each weight row is prefetched

inline float dot_tail(const float* x, const int8_t* w, int64_t from, int64_t K) {
  float acc = 0.f;
  for (int64_t i = from; i < K; ++i) acc += x[i] * static_cast<float>(w[i]);
  return acc;
}

// rows o .. o + kRows - 1 of one product
inline void block(const float* x, const int8_t* w, const float* s, float* y, int64_t o, int64_t K) {
  const int8_t* w0 = w + o * K;
  const int8_t* w1 = w0 + K;
  const int8_t* w2 = w1 + K;
  const int8_t* w3 = w2 + K;
  int64_t i = 0;
  float r0, r1, r2, r3;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (; i + 16 <= K; i += 16) {
    if ((i & 63) == 0) {
      __builtin_prefetch(w0 + i + kPrefetch);
      __builtin_prefetch(w1 + i + kPrefetch);
      __builtin_prefetch(w2 + i + kPrefetch);
      __builtin_prefetch(w3 + i + kPrefetch);
    }
    const __m512 xv = _mm512_loadu_ps(x + i);
    a0 = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w0 + i)))), a0);
    a1 = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w1 + i)))), a1);
    a2 = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w2 + i)))), a2);
    a3 = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w3 + i)))), a3);
  }
  r0 = _mm512_reduce_add_ps(a0);
  r1 = _mm512_reduce_add_ps(a1);
  r2 = _mm512_reduce_add_ps(a2);
  r3 = _mm512_reduce_add_ps(a3);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 8 <= K; i += 8) {
    if ((i & 63) == 0) {
      __builtin_prefetch(w0 + i + kPrefetch);
      __builtin_prefetch(w1 + i + kPrefetch);
      __builtin_prefetch(w2 + i + kPrefetch);
      __builtin_prefetch(w3 + i + kPrefetch);
    }
    const __m256 xv = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w0 + i)))), a0);
    a1 = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w1 + i)))), a1);
    a2 = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w2 + i)))), a2);
    a3 = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w3 + i)))), a3);
  }
  alignas(32) float lanes[4][8];
  _mm256_store_ps(lanes[0], a0);
  _mm256_store_ps(lanes[1], a1);
  _mm256_store_ps(lanes[2], a2);
  _mm256_store_ps(lanes[3], a3);
  r0 = r1 = r2 = r3 = 0.f;
  for (int j = 0; j < 8; ++j) {
    r0 += lanes[0][j];
    r1 += lanes[1][j];
    r2 += lanes[2][j];
    r3 += lanes[3][j];
  }
#else
  r0 = r1 = r2 = r3 = 0.f;
#endif
  y[o] = (r0 + dot_tail(x, w0, i, K)) * s[o];
  y[o + 1] = (r1 + dot_tail(x, w1, i, K)) * s[o + 1];
  y[o + 2] = (r2 + dot_tail(x, w2, i, K)) * s[o + 2];
  y[o + 3] = (r3 + dot_tail(x, w3, i, K)) * s[o + 3];
}

}  // namespace

extern "C" {

// y (rows, N) = x (rows, K) q^T (N, K) scaled by s (N,) per output; every tensor contiguous.
AOTI_TORCH_EXPORT void attnkit_int8_matvec(const float* x, const int8_t* w, const float* s, float* y, int64_t rows,
                                           int64_t N, int64_t K) {
  const int64_t blocks = N / kRows;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * K;
    float* yr = y + r * N;
#pragma omp parallel for schedule(static) if (blocks > 1)
    for (int64_t b = 0; b < blocks; ++b) block(xr, w, s, yr, b * kRows, K);
    for (int64_t o = blocks * kRows; o < N; ++o) yr[o] = dot_tail(xr, w + o * K, 0, K) * s[o];
  }
}

// The C shim of attnkit::int8_matvec(Tensor x, Tensor weight, Tensor scale) -> Tensor: a new tensor (..., N) for x
// (..., K). AOTI_TORCH_FAILURE (AOTInductor raises it) for inputs the kernel does not take.
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_int8_matvec(AtenTensorHandle x, AtenTensorHandle weight,
                                                            AtenTensorHandle scale, AtenTensorHandle* ret) {
  int64_t dim = 0, wdim = 0, numel = 0, scales = 0;
  int64_t *sizes = nullptr, *wsizes = nullptr, *wstrides = nullptr, *strides = nullptr;
  int32_t xtype = 0, wtype = 0, stype = 0;
  if (aoti_torch_get_dim(x, &dim) || aoti_torch_get_dim(weight, &wdim) || aoti_torch_get_sizes(x, &sizes) ||
      aoti_torch_get_strides(x, &strides) || aoti_torch_get_sizes(weight, &wsizes) ||
      aoti_torch_get_strides(weight, &wstrides) || aoti_torch_get_numel(x, &numel) ||
      aoti_torch_get_dtype(x, &xtype) || aoti_torch_get_dtype(weight, &wtype) || aoti_torch_get_dtype(scale, &stype) ||
      aoti_torch_get_numel(scale, &scales))
    return AOTI_TORCH_FAILURE;
  if (dim < 1 || wdim != 2 || xtype != aoti_torch_dtype_float32() || wtype != aoti_torch_dtype_int8() ||
      stype != aoti_torch_dtype_float32() || sizes[dim - 1] != wsizes[1] || wstrides[1] != 1 ||
      wstrides[0] != wsizes[1] || scales != wsizes[0])
    return AOTI_TORCH_FAILURE;
  const int64_t K = wsizes[1], N = wsizes[0];
  int64_t expected = 1;  // x contiguous
  for (int64_t d = dim - 1; d >= 0; --d) {
    if (sizes[d] != 1 && strides[d] != expected) return AOTI_TORCH_FAILURE;
    expected *= sizes[d];
  }
  int64_t out_sizes[8], out_strides[8];
  if (dim > 8) return AOTI_TORCH_FAILURE;
  for (int64_t d = 0; d < dim; ++d) out_sizes[d] = sizes[d];
  out_sizes[dim - 1] = N;
  int64_t stride = 1;
  for (int64_t d = dim - 1; d >= 0; --d) {
    out_strides[d] = stride;
    stride *= out_sizes[d];
  }
  AtenTensorHandle out = nullptr;
  if (aoti_torch_empty_strided(dim, out_sizes, out_strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(),
                               0, &out))
    return AOTI_TORCH_FAILURE;
  void *xp = nullptr, *wp = nullptr, *sp = nullptr, *yp = nullptr;
  if (aoti_torch_get_data_ptr(x, &xp) || aoti_torch_get_data_ptr(weight, &wp) ||
      aoti_torch_get_data_ptr(scale, &sp) || aoti_torch_get_data_ptr(out, &yp)) {
    aoti_torch_delete_tensor_object(out);
    return AOTI_TORCH_FAILURE;
  }
  attnkit_int8_matvec(static_cast<const float*>(xp), static_cast<const int8_t*>(wp), static_cast<const float*>(sp),
                      static_cast<float*>(yp), K == 0 ? 0 : numel / K, N, K);
  *ret = out;
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
