// Fixed-width integer types. NVRTC ships no <stdint.h>; nvcc builds (tests, tools) use the real one.
#pragma once
#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
