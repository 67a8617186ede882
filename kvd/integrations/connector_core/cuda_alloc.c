/* kvd's CUDA allocator shim for vLLM: hand vLLM the daemon's CUDA IPC pool.
 *
 * torch.cuda.CUDAPluggableAllocator calls kvd_malloc for every allocation made
 * inside torch.cuda.use_mem_pool(pool). vLLM makes exactly one KV allocation
 * there; kvd_malloc returns the imported pool pointer for an allocation of the
 * pool's size (once) and fails every other request, so nothing else can land in
 * kvd's memory. kvd_free never frees the pool: the daemon owns it.
 *
 * Build: cc -O2 -shared -fPIC -o libkvd_cuda_alloc.so cuda_alloc.c
 * (no CUDA headers needed: the stream is an opaque pointer).
 */
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

static void *kvd_region = NULL;
static size_t kvd_region_nbytes = 0;
static int kvd_region_served = 0;

void kvd_set_region(void *ptr, size_t nbytes) {
    kvd_region = ptr;
    kvd_region_nbytes = nbytes;
    kvd_region_served = 0;
}

int kvd_region_was_served(void) { return kvd_region_served; }

void *kvd_malloc(ssize_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    if (kvd_region != NULL && !kvd_region_served && (size_t)size <= kvd_region_nbytes) {
        kvd_region_served = 1;
        return kvd_region;
    }
    return NULL; /* torch raises an out-of-memory error: nothing else belongs here */
}

void kvd_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)device;
    (void)stream;
    if (ptr == kvd_region) {
        kvd_region_served = 0; /* the pool itself stays: the daemon owns it */
    }
}
