/*
 * _attn_blocks.c — output memory the Python package recycles.
 *
 * Every call hands back fresh outputs (out, lse, dq, dk, dv), and a training
 * or decoding loop frees last step's outputs just before asking for the same
 * sizes again. glibc gives freed megabytes back to the kernel once its heap
 * top passes its trim threshold, so the next step faults every page in anew,
 * 4 KiB at a time: at (1, 8, 512, 512, 64) causal, 481 faults and 0.8 ms of a
 * 7.4 ms forward+backward on the Zen 4 machine, paid by attn alone (PyTorch's
 * own temporaries happen to keep glibc's thresholds high). A block here is a
 * buffer-protocol object over memory that returns to a small pool when its
 * last view dies, and is handed out again for the same size: warm pages, no
 * faults. The pool keeps at most KEEP_SLOTS blocks and KEEP_BYTES in all,
 * newest first; attn.release_workspace() empties it. Outputs outside
 * [KEEP_MIN, KEEP_MAX] are NumPy's own (python/attn/_arrays.py empty()).
 */
#include "_attn_shared.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>

/* Blocks under KEEP_MIN are malloc's business (it recycles those well);
 * blocks over KEEP_MAX are rare and costly enough that faulting is noise. */
enum { KEEP_SLOTS = 16, BLOCK_ALIGN = 64 };
static const size_t KEEP_MIN = (size_t)256 << 10;
static const size_t KEEP_MAX = (size_t)32 << 20;
static const size_t KEEP_BYTES = (size_t)64 << 20;

static struct {
    void *data[KEEP_SLOTS]; /* oldest first */
    size_t size[KEEP_SLOTS];
    int count;
    size_t bytes;
} pool;
/* Blocks die wherever their last view dies: under the GIL today, but a
 * free-threaded Python has none. */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

/* A fresh block. From 4 MiB on, aligned to 2 MiB and offered to the kernel
 * as transparent huge pages, as NumPy's own allocator does for such sizes. */
static void *block_alloc(size_t size) {
    enum { HUGE_PAGE = 2 << 20, HUGE_FROM = 4 << 20 };
    void *p = NULL;
#ifdef MADV_HUGEPAGE
    if (size >= HUGE_FROM) {
        if (posix_memalign(&p, HUGE_PAGE, size) != 0) return NULL;
        (void)madvise(p, size & ~(size_t)(HUGE_PAGE - 1), MADV_HUGEPAGE);
        return p;
    }
#endif
    return posix_memalign(&p, BLOCK_ALIGN, size) == 0 ? p : NULL;
}

/* Takes slot i out of the pool (the lock held): its block, the later slots
 * moved down one. */
static void *pool_remove(int i) {
    void *p = pool.data[i];
    pool.bytes -= pool.size[i];
    pool.count--;
    for (int j = i; j < pool.count; j++) {
        pool.data[j] = pool.data[j + 1];
        pool.size[j] = pool.size[j + 1];
    }
    return p;
}

static void *pool_take(size_t size) {
    void *p = NULL;
    pthread_mutex_lock(&pool_lock);
    for (int i = pool.count - 1; i >= 0 && p == NULL; i--)
        if (pool.size[i] == size) p = pool_remove(i);
    pthread_mutex_unlock(&pool_lock);
    if (p == NULL) p = block_alloc(size);
    return p;
}

static void pool_give(void *p, size_t size) {
    if (size < KEEP_MIN || size > KEEP_MAX) {
        free(p);
        return;
    }
    void *evicted[KEEP_SLOTS + 1];
    int n_evicted = 0;
    pthread_mutex_lock(&pool_lock);
    pool.data[pool.count] = p; /* a free slot: count < KEEP_SLOTS between calls */
    pool.size[pool.count] = size;
    pool.count++;
    pool.bytes += size;
    while (pool.count > 0 && (pool.bytes > KEEP_BYTES || pool.count == KEEP_SLOTS))
        evicted[n_evicted++] = pool_remove(0); /* the oldest */
    pthread_mutex_unlock(&pool_lock);
    for (int i = 0; i < n_evicted; i++) free(evicted[i]);
}

void output_blocks_release(void) {
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < pool.count; i++) free(pool.data[i]);
    pool.count = 0;
    pool.bytes = 0;
    pthread_mutex_unlock(&pool_lock);
}

/* ---- the block object: a writable buffer of `size` bytes ---- */

typedef struct {
    PyObject_HEAD
    void *data;
    Py_ssize_t size;
} BlockObject;

static int block_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    BlockObject *b = (BlockObject *)self;
    return PyBuffer_FillInfo(view, self, b->data, b->size, 0, flags);
}

static void block_dealloc(PyObject *self) {
    BlockObject *b = (BlockObject *)self;
    if (b->data != NULL) pool_give(b->data, (size_t)b->size);
    Py_TYPE(self)->tp_free(self);
}

static PyBufferProcs block_as_buffer = {block_getbuffer, NULL};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "attn._attn.OutputBlock",
    .tp_basicsize = sizeof(BlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "output memory that returns to attn's pool when its last view dies",
    .tp_dealloc = block_dealloc,
    .tp_as_buffer = &block_as_buffer,
};

/* output_block(nbytes): a block of nbytes, recycled when one of that size is
 * kept, else fresh (64-byte aligned either way). */
static PyObject *py_output_block(PyObject *self, PyObject *arg) {
    (void)self;
    const Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n <= 0) return PyErr_Format(PyExc_ValueError, "output_block: %zd bytes", n);
    BlockObject *b = PyObject_New(BlockObject, &BlockType);
    if (b == NULL) return NULL;
    b->size = n;
    b->data = pool_take((size_t)n);
    if (b->data == NULL) {
        Py_DECREF(b);
        return PyErr_NoMemory();
    }
    return (PyObject *)b;
}

/* output_blocks_kept(): (blocks, bytes) the pool holds now. */
static PyObject *py_output_blocks_kept(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    pthread_mutex_lock(&pool_lock);
    const int count = pool.count;
    const size_t bytes = pool.bytes;
    pthread_mutex_unlock(&pool_lock);
    return Py_BuildValue("(in)", count, (Py_ssize_t)bytes);
}

static PyMethodDef block_methods[] = {
    {"output_block", py_output_block, METH_O, "a recycled output buffer of n bytes"},
    {"output_blocks_kept", py_output_blocks_kept, METH_NOARGS,
     "(blocks, bytes) the output pool keeps now"},
    {NULL, NULL, 0, NULL}};

/* The functions, and the sizes the pool keeps (OUTPUT_BLOCK_MIN/MAX, bytes:
 * python/attn/_arrays.py empty() makes blocks only for those). */
int output_blocks_add(PyObject *module) {
    if (PyType_Ready(&BlockType) < 0 || PyModule_AddFunctions(module, block_methods) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "OUTPUT_BLOCK_MIN", (long)KEEP_MIN) < 0 ||
        PyModule_AddIntConstant(module, "OUTPUT_BLOCK_MAX", (long)KEEP_MAX) < 0)
        return -1;
    return 0;
}
