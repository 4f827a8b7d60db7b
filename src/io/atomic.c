/*
 * atomic.c — replacing a file so that no one ever sees it half written: the
 * bytes go to a temporary file in the target's folder (so that the rename
 * stays within one file system), are flushed to disk, and only then is the
 * temporary renamed over the target. A failure removes the temporary.
 * attn_npy_save and attn_safetensors_save write through here.
 */
#define _XOPEN_SOURCE 700 /* openat, renameat, unlinkat, fsync; realpath is XSI */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "io.h"

/* write(2) until done: a signal or a pipe may cut a write short. Returns 0
 * or an errno value. */
int attn__write_all(int fd, const void *bytes, size_t n) {
    const unsigned char *p = bytes;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return errno;
        if (w == 0) return EIO;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The file a write to path creates when path is a symbolic link whose
 * target is not there (a chain of links followed to its end, as open(2)
 * with O_CREAT does): its path, in out (cap bytes). Returns 0, ENOENT when
 * path is not a link (the file is path itself), or an errno value. */
int attn__dangling_link_target(const char *path, char *out, size_t cap) {
    char link[PATH_MAX], next[PATH_MAX];
    struct stat st;
    if (strlen(path) >= sizeof link) return ENAMETOOLONG;
    strcpy(link, path);
    for (int hops = 0; lstat(link, &st) == 0 && S_ISLNK(st.st_mode); hops++) {
        if (hops == 40) return ELOOP; /* the kernel's limit */
        const ssize_t n = readlink(link, next, sizeof next);
        if (n < 0) return errno;
        if ((size_t)n >= sizeof next) return ENAMETOOLONG;
        next[n] = '\0';
        /* A relative target is relative to the link's folder. */
        const char *slash = strrchr(link, '/');
        if (next[0] != '/' && slash != NULL) {
            const size_t dir = (size_t)(slash - link) + 1;
            if (dir + (size_t)n >= sizeof link) return ENAMETOOLONG;
            memmove(link + dir, next, (size_t)n + 1);
        } else {
            memcpy(link, next, (size_t)n + 1);
        }
    }
    if (strcmp(link, path) == 0) return ENOENT;
    if (strlen(link) >= cap) return ENAMETOOLONG;
    strcpy(out, link);
    return 0;
}

/* The file a save replaces: its folder (open) and its name there. */
typedef struct target {
    int dir_fd;
    char name[NAME_MAX + 1];
    bool exists;
    struct stat st; /* when it exists */
} target;

/* Finds the folder and name. A symbolic link is followed, so that the file
 * it points to is replaced (or, for a dangling link, created), not the
 * link. Returns 0 or an errno value. */
static int open_target(const char *path, target *t) {
    char full[PATH_MAX], dir[PATH_MAX];
    const char *p = path;
    t->dir_fd = -1;
    t->exists = false;
    if (path[0] == '\0') return ENOENT;
    if (realpath(path, full) != NULL) {
        if (stat(full, &t->st) != 0) return errno;
        if (S_ISDIR(t->st.st_mode)) return EISDIR;
        t->exists = true;
        p = full;
    } else if (errno != ENOENT) {
        return errno; /* ENAMETOOLONG, ELOOP, EACCES, ENOTDIR, ... */
    } else {
        const int err = attn__dangling_link_target(path, full, sizeof full);
        if (err == 0) p = full; /* the link stays; its target is created */
        else if (err != ENOENT) return err;
    }
    const size_t len = strlen(p);
    if (len >= sizeof dir) return ENAMETOOLONG;
    memcpy(dir, p, len + 1);
    char *slash = strrchr(dir, '/');
    const char *name = slash != NULL ? slash + 1 : dir;
    if (name[0] == '\0' || strcmp(name, ".") == 0 || strcmp(name, "..") == 0) return EISDIR;
    if (strlen(name) > NAME_MAX) return ENAMETOOLONG;
    strcpy(t->name, name);
    if (slash == NULL)
        strcpy(dir, ".");
    else
        slash[slash == dir ? 1 : 0] = '\0'; /* "/x" is in "/" */
    t->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    return t->dir_fd < 0 ? errno : 0;
}

/* Creates ".NAME.XXXXXXXX.tmp" beside the target; O_EXCL never reuses a
 * file that exists. Returns 0 or an errno value. */
static int create_temp(const target *t, char temp[NAME_MAX + 1], int *fd) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    /* Different for every process, thread (the stack address) and moment. */
    unsigned long long x = (unsigned long long)getpid() << 32 ^ (unsigned long long)ts.tv_nsec ^
                           (unsigned long long)(uintptr_t)temp;
    for (int attempt = 0; attempt < 100; attempt++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        snprintf(temp, NAME_MAX + 1, ".%.200s.%08x.tmp", t->name, (unsigned)(x >> 32));
        *fd = openat(t->dir_fd, temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (*fd >= 0) return 0;
        if (errno != EEXIST) return errno;
    }
    return EEXIST;
}

/* Temporary, write, fsync, rename. Returns 0 or an errno value and says
 * which step failed in *what. */
static int replace(const target *tg, attn__file_writer writer, const void *ctx,
                   const char **what) {
    char temp[NAME_MAX + 1];
    int fd;
    *what = "cannot create a temporary file beside";
    int err = create_temp(tg, temp, &fd);
    if (err != 0) return err;
    *what = "cannot write";
    if (tg->exists) { /* the new file keeps the old one's owner and permission bits */
        if (fchown(fd, tg->st.st_uid, tg->st.st_gid) != 0) {
            /* only root may give a file away: it stays the caller's */
        }
        if (fchmod(fd, tg->st.st_mode & 0777) != 0) err = errno;
    }
    if (err == 0) err = writer(fd, ctx);
    /* On disk before the name points at it: a crash never shows a file
     * whose data was not written. */
    if (err == 0 && fsync(fd) != 0) err = errno;
    if (close(fd) != 0 && err == 0) err = errno;
    if (err == 0 && renameat(tg->dir_fd, temp, tg->dir_fd, tg->name) != 0) {
        err = errno;
        *what = "cannot rename the temporary file over";
    }
    if (err != 0) {
        unlinkat(tg->dir_fd, temp, 0);
        return err;
    }
    /* Makes the rename durable. Some file systems refuse to sync a folder;
     * the file is in place either way, so this cannot fail the save. */
    (void)fsync(tg->dir_fd);
    return 0;
}

/* A device or FIFO (/dev/null, a pipe) cannot be replaced; it is written in
 * place, as before. */
int attn__open_in_place(const char *path, int *fd) {
    for (int waited = 0;; waited += 10) { /* ms */
        *fd = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC | O_NONBLOCK);
        if (*fd >= 0) break;
        const int err = errno;
        struct stat st;
        if (err != ENXIO || waited >= ATTN__FIFO_READER_WAIT_MS || stat(path, &st) != 0 ||
            !S_ISFIFO(st.st_mode))
            return err;
        const struct timespec step = {0, 10 * 1000 * 1000};
        nanosleep(&step, NULL); /* a signal cuts it short: the loop asks again */
    }
    const int flags = fcntl(*fd, F_GETFL);
    if (flags < 0 || fcntl(*fd, F_SETFL, flags & ~O_NONBLOCK) < 0) { /* the writes may wait */
        const int err = errno;
        close(*fd);
        *fd = -1;
        return err;
    }
    return 0;
}

const char *attn__in_place_error(const char *path, int err) {
    struct stat st;
    if (err == ENXIO && stat(path, &st) == 0 && S_ISFIFO(st.st_mode))
        return "a FIFO that no process opened for reading within 5 s";
    return strerror(err);
}

static int write_in_place(const char *path, attn__file_writer writer, const void *ctx) {
    int fd;
    int err = attn__open_in_place(path, &fd);
    if (err != 0) return err;
    err = writer(fd, ctx);
    if (close(fd) != 0 && err == 0) err = errno;
    return err;
}

attn_status attn__save_atomic(const char *path, attn__file_writer writer, const void *ctx) {
    target tg;
    const char *what = "cannot write";
    int err = open_target(path, &tg);
    if (err == 0)
        err = tg.exists && !S_ISREG(tg.st.st_mode) ? write_in_place(path, writer, ctx)
                                                   : replace(&tg, writer, ctx, &what);
    if (tg.dir_fd >= 0) close(tg.dir_fd);
    if (err != 0) {
        char shown[ATTN__MESSAGE_PATH];
        return attn__fail(ATTN_ERR_IO, "%s '%s': %s", what, attn__message_path(path, shown),
                          attn__in_place_error(path, err));
    }
    return ATTN_OK;
}
