/* A stub libcuda.so.1 for driver-level tests and host-cost measurements without a GPU
   (tests/test_graph.py, tools/bench_host.py): enough of the driver API for rtattn's
   graph and launch paths; graph/launch calls print what they were given. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include <stdlib.h>
typedef int R;
/* STUB_QUIET=1: print nothing (host-cost timing) */
static int quiet = -1;
static int loud(void) { if (quiet < 0) quiet = getenv("STUB_QUIET") != 0; return !quiet; }
#define SAY(...) do { if (loud()) printf(__VA_ARGS__); } while (0)
typedef struct { void* func; unsigned gx, gy, gz, bx, by, bz, smem; void** params; void** extra; void* kern; void* ctx; } KP;
typedef struct { int result; void* errorNode; void* errorFromNode; } UI;
R cuInit(unsigned f) { return 0; }
R cuDriverGetVersion(int* v) { *v = 13000; return 0; }
R cuDeviceGetCount(int* n) { *n = 1; return 0; }
R cuDeviceGet(int* d, int o) { *d = o; return 0; }
R cuDeviceGetName(char* n, int len, int d) { strncpy(n, "stub", len); return 0; }
R cuDeviceGetAttribute(int* v, int a, int d) { *v = a == 75 ? 9 : (a == 76 ? 0 : 1024); return 0; }
R cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)0xC0; return 0; }
static __thread void* current_ctx;   /* the driver's per-thread current context */
R cuCtxSetCurrent(void* c) { current_ctx = c; return 0; }
R cuCtxGetCurrent(void** c) { *c = current_ctx; return 0; }
R cuCtxGetDevice(int* d) { *d = 0; return current_ctx ? 0 : 201; }
R cuStreamGetCtx(void* s, void** c) { *c = (void*)0xC0; return 0; }   /* one device: every stream is its */
R cuStreamGetCtx_v2(void* s, void** c, void** g) { *c = (void*)0xC0; if (g) *g = 0; return 0; }
R cuGetErrorString(R e, const char** s) { *s = "stub"; return 0; }
R cuGetErrorName(R e, const char** s) { *s = "STUB"; return 0; }
/* kernels launched during a capture become the captured graph's nodes (else: two fixed nodes) */
static int capturing, ncap;
static KP cap[16];
R cuStreamBeginCapture_v2(void* s, int mode) { SAY("begin %p %d\n", s, mode); capturing = 1; ncap = 0; return 0; }
R cuStreamBeginCapture(void* s, int mode) { return cuStreamBeginCapture_v2(s, mode); }
R cuStreamEndCapture(void* s, void** g) { *g = (void*)0xABC0; SAY("end %p\n", s); capturing = 0; return 0; }
R cuGraphGetNodes(void* g, void** nodes, size_t* n) {
  size_t have = ncap ? (size_t)ncap : 2;
  if (!nodes) { *n = have; return 0; }
  for (size_t i = 0; i < *n; i++) nodes[i] = i < have ? (void*)(0x1000 * (i + 1)) : 0;
  *n = have; return 0; }
R cuGraphNodeGetType(void* node, int* t) { *t = 0; return 0; }
R cuGraphKernelNodeGetParams_v2(void* node, KP* p) {
  size_t i = (uintptr_t)node / 0x1000 - 1;
  if (ncap && i < (size_t)ncap) { *p = cap[i]; return 0; }
  memset(p, 0, sizeof *p); p->func = (void*)0x11000;   /* two nodes of one kernel (two layers) */
  p->gx = 132; p->gy = 8; p->gz = 1; p->bx = 128; p->by = p->bz = 1; p->smem = 4096; return 0; }
R cuGraphKernelNodeGetParams(void* node, KP* p) { return cuGraphKernelNodeGetParams_v2(node, p); }
R cuGraphExecKernelNodeSetParams_v2(void* ex, void* node, const KP* p) {
  SAY("setparams %p func=%p grid=%u,%u,%u block=%u smem=%u arg=%.6s\n", node, p->func, p->gx, p->gy, p->gz,
         p->bx, p->smem, (const char*)p->params[0]); return 0; }
R cuGraphExecKernelNodeSetParams(void* ex, void* node, const KP* p) { return cuGraphExecKernelNodeSetParams_v2(ex, node, p); }
R cuGraphInstantiateWithFlags(void** ex, void* g, unsigned long long f) { *ex = (void*)0xE0E0; SAY("instantiate\n"); return 0; }
R cuGraphExecUpdate_v2(void* ex, void* g, UI* info) {
  SAY("update %p\n", g);
  if ((uintptr_t)g == 0xBAD0) { info->result = 2; return 910; }
  info->result = 0; return 0; }
R cuGraphExecUpdate(void* ex, void* g, UI* info) { return cuGraphExecUpdate_v2(ex, g, info); }
R cuGraphLaunch(void* ex, void* s) { SAY("launch %p\n", s); return 0; }
typedef struct { int id; char pad[4]; union { char pad[64]; int pss; } value; } LA;   /* CUlaunchAttribute */
typedef struct { unsigned gx, gy, gz, bx, by, bz, smem; void* stream; LA* attrs; unsigned n; } LC;
R cuLaunchKernelEx(const LC* c, void* f, void** params, void** extra) {
  if (capturing && ncap < 16) {
    KP* k = &cap[ncap++]; memset(k, 0, sizeof *k);
    k->func = f; k->gx = c->gx; k->gy = c->gy; k->gz = c->gz; k->bx = c->bx; k->by = c->by; k->bz = c->bz;
    k->smem = c->smem; }
  SAY("launchex f=%p grid=%u,%u,%u block=%u,%u,%u smem=%u stream=%p attrs=%u", f, c->gx, c->gy, c->gz,
         c->bx, c->by, c->bz, c->smem, c->stream, c->n);
  if (c->n) SAY(" attr=%d:%d", c->attrs[0].id, c->attrs[0].value.pss);
  SAY(" arg=%.6s\n", (const char*)params[0]); return 0; }
/* plan(): pinned host memory, its async copy and the copy's event (nothing is copied) */
R cuMemHostAlloc(void** p, size_t n, unsigned f) { *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096); return *p ? 0 : 2; }
R cuMemFreeHost(void* p) { free(p); return 0; }
R cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* s) { return 0; }
R cuMemcpyHtoDAsync(unsigned long long dst, const void* src, size_t n, void* s) { return 0; }
static char events[64];
R cuEventCreate(void** e, unsigned f) { static int next; *e = events + (next++ % 64); return 0; }
R cuEventRecord(void* e, void* s) { return 0; }
R cuEventSynchronize(void* e) { return 0; }
R cuEventQuery(void* e) { return 0; }
R cuEventDestroy_v2(void* e) { return 0; }
R cuEventDestroy(void* e) { return 0; }
R cuGraphDestroy(void* g) { return 0; }
R cuGraphExecDestroy(void* e) { return 0; }
R cuGetProcAddress_v2(const char* sym, void** pfn, int ver, unsigned long long flags, int* status) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  *pfn = h ? dlsym(h, sym) : 0;
  if (status) *status = *pfn ? 0 : 1;
  return *pfn ? 0 : 500; }
