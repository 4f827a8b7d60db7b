/* alloc.c — every byte libattn allocates goes through here, so a caller can
 * own memory, and tests can fail the n-th allocation (SQLite-style). */
#define _DEFAULT_SOURCE /* madvise */
#include <stdatomic.h>
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

static void release_kept(void);

void attn_set_allocator(const attn_allocator *a) {
    release_kept(); /* kept blocks go back to the allocator that made them */
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

/* count · elem_size in *bytes; false (the message set) when it overflows. */
static bool array_bytes(size_t count, size_t elem_size, size_t *bytes) {
    if (elem_size != 0 && count > SIZE_MAX / elem_size) {
        attn__fail(ATTN_ERR_NOMEM, "cannot allocate %zu elements of %zu bytes", count,
                   elem_size);
        return false;
    }
    *bytes = count * elem_size;
    return true;
}

void *attn__alloc_array(size_t count, size_t elem_size) {
    size_t size;
    if (!array_bytes(count, elem_size, &size)) return NULL;
    void *p = attn__alloc(size);
    if (p != NULL) memset(p, 0, size);
    return p;
}

void attn__free(void *ptr) {
    if (ptr != NULL) allocator.release(allocator.ctx, ((void **)ptr)[-1]);
}

/* ---- workspace kept between calls ----
 *
 * A call's workspace (the fused kernels' per-thread scratch, the partial
 * results of split keys, MHA's projections, the backward's sums) lives for
 * one call. glibc gives a freed block of a few MiB back to the kernel
 * (munmap, or trimming the top of the heap), so a program calling attn in a
 * loop faulted its workspace in afresh on every call: a decoding step of
 * (1, 32 heads, 32,768 keys, E = 128) took 510 page faults (2 MiB) and
 * 10-12% longer (Zen 4, docs/design.md "Workspace"). Freed workspace blocks
 * of WORK_KEEP_MIN bytes or more therefore wait in a few slots, at most
 * WORK_KEEP_MAX bytes in all, and a later request takes the smallest one
 * that holds it (and is not more than twice its size, so that a small
 * request does not pin a large block). attn_release_workspace() and
 * attn_set_allocator() hand them back. Each block carries its capacity in a
 * header of ALIGN bytes. */
enum { WORK_SLOTS = 8, WORK_KEEP_MIN = 64 << 10 };
#define WORK_KEEP_MAX ((size_t)64 << 20)

static _Atomic(char *) work_slot[WORK_SLOTS]; /* blocks (their headers), or NULL */
static _Atomic size_t work_slot_cap[WORK_SLOTS]; /* each slot's capacity, a hint  */
static _Atomic size_t work_kept;              /* bytes in the slots             */

static size_t work_capacity(const char *block) { return *(const size_t *)block; }
static bool work_fits(size_t cap, size_t size) { return cap >= size && cap / 2 <= size; }

/* The block of the slot that fits `size` best, taken out of its slot; NULL
 * when none fits (or another thread took it first). A block is only read
 * once this thread owns it: the scan goes by the slots' capacity hints, as
 * a block still in a slot may be taken and freed by another thread at any
 * moment (attn_release_workspace). A hint can be stale (two threads filling
 * one slot): a block that turns out not to fit goes back (attn__work_free). */
static char *take_kept(size_t size) {
    int best = -1;
    size_t best_cap = 0;
    for (int i = 0; i < WORK_SLOTS; i++) {
        if (atomic_load(&work_slot[i]) == NULL) continue;
        const size_t cap = atomic_load(&work_slot_cap[i]);
        if (work_fits(cap, size) && (best < 0 || cap < best_cap)) best = i, best_cap = cap;
    }
    if (best < 0) return NULL;
    char *b = atomic_exchange(&work_slot[best], NULL);
    if (b == NULL) return NULL;
    atomic_fetch_sub(&work_kept, work_capacity(b));
    if (work_fits(work_capacity(b), size)) return b;
    attn__work_free(b + ALIGN); /* swapped in meanwhile: back to a slot, or freed */
    return NULL;
}

static void release_kept(void) {
    for (int i = 0; i < WORK_SLOTS; i++) {
        char *b = atomic_exchange(&work_slot[i], NULL);
        if (b == NULL) continue;
        atomic_fetch_sub(&work_kept, work_capacity(b));
        attn__free(b);
    }
}

#ifdef ATTN_POISON_WORKSPACE
/* Fills with 0x3f in pieces. The first touch of a large buffer costs page
 * faults (a second for an MHA's 270 MB on a loaded VM), which a release
 * build spends inside work that checks the cancel flag: so the filling stops
 * too when the calling thread's call is cancelled (its results are
 * discarded; the fill only catches reads before writes). */
static void poison(char *p, size_t size) {
    const size_t piece = (size_t)8 << 20;
    for (size_t at = 0; at < size; at += piece) {
        if (attn__cancelled(attn__cancel_flag())) return;
        memset(p + at, 0x3f, size - at < piece ? size - at : piece);
    }
}
#endif

void *attn__work_alloc(size_t count, size_t elem_size, bool zeroed) {
    size_t size;
    if (!array_bytes(count, elem_size, &size)) return NULL;
    if (size > SIZE_MAX - ALIGN) { /* the header's ALIGN bytes must fit too */
        attn__fail(ATTN_ERR_NOMEM, "cannot allocate %zu bytes", size);
        return NULL;
    }
    char *b = size >= WORK_KEEP_MIN ? take_kept(size) : NULL;
    if (b == NULL) {
        b = attn__alloc(size + ALIGN);
        if (b == NULL) return NULL;
        *(size_t *)b = size;
    }
    char *p = b + ALIGN;
    if (zeroed)
        memset(p, 0, size);
#ifdef ATTN_POISON_WORKSPACE
    /* Sanitizer builds: a read before a write meets 0x3f bytes, not zeros:
     * finite floats (0.747f; NaN would only send the row to the reference
     * kernel, which hides it), huge indices, invalid bools for UBSan. */
    else
        poison(p, size);
#endif
    return p;
}

void attn__work_free(void *ptr) {
    if (ptr == NULL) return;
    char *b = (char *)ptr - ALIGN;
    const size_t cap = work_capacity(b);
    if (cap >= WORK_KEEP_MIN && cap <= WORK_KEEP_MAX) {
        size_t kept = atomic_load(&work_kept);
        while (kept + cap <= WORK_KEEP_MAX &&
               !atomic_compare_exchange_weak(&work_kept, &kept, kept + cap)) {
        }
        if (kept + cap <= WORK_KEEP_MAX) { /* counted in: find it a slot */
            for (int i = 0; i < WORK_SLOTS; i++) {
                if (atomic_load(&work_slot[i]) != NULL) continue;
                atomic_store(&work_slot_cap[i], cap); /* before the block is visible */
                char *empty = NULL;
                if (atomic_compare_exchange_strong(&work_slot[i], &empty, b)) return;
            }
            atomic_fetch_sub(&work_kept, cap);
        }
    }
    attn__free(b);
}

void attn_release_workspace(void) { release_kept(); }

/* The public doors to the same allocator (attn.h: for libraries on attn). */
void *attn_alloc(size_t size) { return size == 0 ? NULL : attn__alloc(size); }
void attn_free(void *ptr) { attn__free(ptr); }
