/* alloc.c — every byte libattn allocates goes through here, so a caller can
 * own memory, and tests can fail the n-th allocation (SQLite-style). */
#define _DEFAULT_SOURCE /* madvise */
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>

#include "internal.h"

/* MHA's workspace reaches tens of MiB per call (BERT-base, batch 8: a
 * 38 MiB Q/K/V buffer). glibc's malloc recycles freed blocks up to 32 MiB
 * (its largest dynamic mmap threshold) but maps anything bigger afresh on
 * every call, and faulting that in 4 KiB at a time cost 18% of the call
 * (measured). Such blocks are aligned to 2 MiB and offered to the kernel as
 * transparent huge pages: 512 times fewer faults; a hint, ignored where THP
 * is off. Smaller blocks stay with malloc, which reuses them. */
enum { HUGE_PAGE = 2 << 20, HUGE_FROM = 32 << 20 };

static void *default_alloc(void *ctx, size_t size) {
    (void)ctx;
#ifdef MADV_HUGEPAGE
    if (size >= HUGE_FROM) {
        void *p = NULL;
        if (posix_memalign(&p, HUGE_PAGE, size) != 0) return NULL;
        (void)madvise(p, size & ~(size_t)(HUGE_PAGE - 1), MADV_HUGEPAGE);
        return p;
    }
#endif
    return malloc(size);
}
static void default_release(void *ctx, void *ptr) {
    (void)ctx;
    free(ptr);
}

static attn_allocator allocator = {default_alloc, default_release, NULL};

void attn_set_allocator(const attn_allocator *a) {
    if (a != NULL && a->alloc != NULL && a->release != NULL)
        allocator = *a;
    else
        allocator = (attn_allocator){default_alloc, default_release, NULL};
}

/* Blocks are aligned to a cache line for the vector kernels: over-allocate,
 * and keep the hook's own pointer just below the aligned address. */
enum { ALIGN = 64 };

void *attn__alloc(size_t size) {
    if (size > SIZE_MAX - ALIGN - sizeof(void *)) {
        attn__fail(ATTN_ERR_NOMEM, "cannot allocate %zu bytes", size);
        return NULL;
    }
    void *raw = allocator.alloc(allocator.ctx, size + ALIGN + sizeof(void *));
    if (raw == NULL) {
        attn__fail(ATTN_ERR_NOMEM, "out of memory allocating %zu bytes", size);
        return NULL;
    }
    uintptr_t p = ((uintptr_t)raw + sizeof(void *) + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1);
    ((void **)p)[-1] = raw;
    return (void *)p;
}

void *attn__alloc_array(size_t count, size_t elem_size) {
    if (elem_size != 0 && count > SIZE_MAX / elem_size) {
        attn__fail(ATTN_ERR_NOMEM, "cannot allocate %zu elements of %zu bytes", count,
                   elem_size);
        return NULL;
    }
    void *p = attn__alloc(count * elem_size);
    if (p != NULL) memset(p, 0, count * elem_size);
    return p;
}

void attn__free(void *ptr) {
    if (ptr != NULL) allocator.release(allocator.ctx, ((void **)ptr)[-1]);
}

/* The public doors to the same allocator (attn.h: for libraries on attn). */
void *attn_alloc(size_t size) { return size == 0 ? NULL : attn__alloc(size); }
void attn_free(void *ptr) { attn__free(ptr); }
