/* reduce.c -- Reductions: sum/prod/max/min/avg over every NCCL data type, fp16 and bf16
 * included, as NCCL computes them. */
#include "nccl_sim.h"

/* ------------------------------------------------------------ reduction -- */
static inline float h2f(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t f2h(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }
static inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

#define RED_LOOP(T, UT)                                                            \
  do {                                                                             \
    T *d = (T *)dst; const T *s = (const T *)src;                                  \
    switch (op) {                                                                  \
      case ncclSum: case ncclAvg: for (size_t i = 0; i < n; i++) d[i] = (T)((UT)d[i] + (UT)s[i]); break; \
      case ncclProd: for (size_t i = 0; i < n; i++) d[i] = (T)((UT)d[i] * (UT)s[i]); break;   \
      case ncclMax: for (size_t i = 0; i < n; i++) d[i] = d[i] > s[i] ? d[i] : s[i]; break;   \
      case ncclMin: for (size_t i = 0; i < n; i++) d[i] = d[i] < s[i] ? d[i] : s[i]; break;   \
      default: break;                                                              \
    }                                                                              \
  } while (0)

static inline float redf(float a, float b, int op) {
  switch (op) {
    case ncclProd: return a * b;
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return a + b;
  }
}

/* dst = dst op src, n elements */
void reduce_into(void *dst, const void *src, size_t n, int dt, int op) {
  switch (dt) {
    case ncclInt8: RED_LOOP(int8_t, uint8_t); break;
    case ncclUint8: RED_LOOP(uint8_t, uint8_t); break;
    case ncclInt32: RED_LOOP(int32_t, uint32_t); break;
    case ncclUint32: RED_LOOP(uint32_t, uint32_t); break;
    case ncclInt64: RED_LOOP(int64_t, uint64_t); break;
    case ncclUint64: RED_LOOP(uint64_t, uint64_t); break;
    case ncclFloat32: RED_LOOP(float, float); break;
    case ncclFloat64: RED_LOOP(double, double); break;
    case ncclFloat16: {
      uint16_t *d = dst; const uint16_t *s = src;
      for (size_t i = 0; i < n; i++) d[i] = f2h(redf(h2f(d[i]), h2f(s[i]), op));
      break;
    }
    case ncclBfloat16: {
      uint16_t *d = dst; const uint16_t *s = src;
      for (size_t i = 0; i < n; i++) d[i] = f2bf(redf(bf2f(d[i]), bf2f(s[i]), op));
      break;
    }
    default: break;
  }
}

#define DIV_LOOP(T) do { T *d = (T *)buf; for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] / (T)k); } while (0)
void divide_by(void *buf, size_t n, int dt, int k) {
  switch (dt) {
    case ncclInt8: DIV_LOOP(int8_t); break;
    case ncclUint8: DIV_LOOP(uint8_t); break;
    case ncclInt32: DIV_LOOP(int32_t); break;
    case ncclUint32: DIV_LOOP(uint32_t); break;
    case ncclInt64: DIV_LOOP(int64_t); break;
    case ncclUint64: DIV_LOOP(uint64_t); break;
    case ncclFloat32: DIV_LOOP(float); break;
    case ncclFloat64: DIV_LOOP(double); break;
    case ncclFloat16: { uint16_t *d = buf; for (size_t i = 0; i < n; i++) d[i] = f2h(h2f(d[i]) / (float)k); break; }
    case ncclBfloat16: { uint16_t *d = buf; for (size_t i = 0; i < n; i++) d[i] = f2bf(bf2f(d[i]) / (float)k); break; }
    default: break;
  }
}

int reducible(int dt, int op) {
  return dt >= 0 && dt <= ncclBfloat16 && op >= 0 && op < ncclNumOps;
}
