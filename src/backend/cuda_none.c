// backend: the CUDA entry points of a build without a CUDA compiler: no GPU, said plainly.

#include "backend/backend.h"

#ifndef STRATA_HAVE_CUDA
bool st_cuda_available(void) { return false; }

st_status st_cuda_devices(st_gpu_info *out, int max, int *n, char *why, size_t why_len) {
    (void)out, (void)max;
    *n = 0;
    if (why) snprintf(why, why_len, "this build of Strata has no CUDA backend (no nvcc when it was built)");
    return ST_OK;
}

double st_cuda_copy_gbs(int device) {
    (void)device;
    return 0;
}

st_status st_backend_cuda_create(int device, size_t reserve_bytes, int n_threads, st_backend **out) {
    (void)device, (void)reserve_bytes, (void)n_threads;
    *out = NULL;
    return st_fail(ST_ERR_UNSUPPORTED, "this build of Strata has no CUDA backend (rebuild with nvcc installed: "
                   "./setup.sh)");
}
#endif
