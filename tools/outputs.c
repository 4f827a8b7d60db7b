/*
 * outputs.c — a command's output files: all of them, or none.
 *
 * outputs_add resolves each target (its folder, opened, and its name) and
 * refuses two options naming one file. outputs_stage writes a tensor (or,
 * through outputs_stage_with, any file: the heatmap's PNG) in full
 * to a temporary file in its target's folder and flushes it to disk.
 * outputs_commit renames every temporary over its target, but only once all
 * are complete; outputs_abort removes them. SIGINT, SIGTERM and SIGHUP
 * remove them too before the tool dies of the signal, so a failed or
 * interrupted run leaves every target as it was. outputs_input registers
 * the command's input files, which no output may replace.
 *
 * Like attn_npy_save, a symbolic link is followed (the file it points to is
 * replaced, or created when the link dangles) and an existing target that
 * is not a regular file (/dev/null, a FIFO) is written in place, at commit
 * time, before the renames.
 *
 * A file several processes write (attn sdpa --ring) is staged by one of
 * them, which alone creates, commits or removes the temporary; the others
 * open it by name (outputs_open_temp) to write their parts.
 */
#define _XOPEN_SOURCE 700 /* openat, renameat, unlinkat, fsync, sigaction; realpath */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "io/io.h" /* attn__dangling_link_target, attn__open_in_place */

enum { MAX_OUTPUTS = 8 };

typedef struct output {
    const char *option, *path;
    output_writer write;       /* staged, or to be written in place */
    const void *ctx;
    int dir_fd;
    char name[NAME_MAX + 1], temp[NAME_MAX + 1];
    volatile sig_atomic_t temp_exists; /* read by the signal handler */
    bool exists, in_place;             /* in place: an existing device or FIFO */
    dev_t dev;                         /* of the file if it exists, else the folder's */
    ino_t ino;
} output;

/* Static, so that the signal handler can reach the temporaries' names. */
static output outputs[MAX_OUTPUTS];
static volatile sig_atomic_t count;

/* The command's input files (outputs_input): an output over one of them
 * would replace what the command reads, so the pair is refused. */
enum { MAX_INPUTS = 24 };
typedef struct input {
    const char *option, *path;
    dev_t dev;
    ino_t ino;
} input;
static input inputs[MAX_INPUTS];
static int ninputs;

/* Where messages go: stderr, or the ring's collector (outputs_set_reporter). */
static void (*reporter)(const char *message);

void outputs_set_reporter(void (*report)(const char *message)) { reporter = report; }

#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
static void say(const char *fmt, ...) {
    char msg[8192];
    va_list ap;
    va_start(ap, fmt);
    if (reporter == NULL) {
        vfprintf(stderr, fmt, ap);
    } else {
        vsnprintf(msg, sizeof msg, fmt, ap);
        reporter(msg);
    }
    va_end(ap);
}

static const int handled[3] = {SIGINT, SIGTERM, SIGHUP};
static pthread_t main_thread; /* the one that stages and commits */

/* Async-signal-safe: pthread_kill, unlinkat, signal and raise only. */
static void on_signal(int sig) {
    /* Blocking signals holds them off one thread only: one that lands on a
     * library worker thread is passed to the main thread, where it waits
     * while a temporary is being created or the renames are under way. */
    if (!pthread_equal(pthread_self(), main_thread)) {
        pthread_kill(main_thread, sig);
        return;
    }
    for (int i = 0; i < count; i++)
        if (outputs[i].temp_exists) unlinkat(outputs[i].dir_fd, outputs[i].temp, 0);
    signal(sig, SIG_DFL);
    raise(sig); /* delivered as the handler returns: the tool dies of it */
}

static void install_handlers(void) {
    main_thread = pthread_self();
    /* A write past the file-size limit (ulimit -f) then fails with EFBIG,
     * which is reported and removes the temporaries, instead of killing the
     * tool with SIGXFSZ and leaving them (as Python does) */
    signal(SIGXFSZ, SIG_IGN);
    /* Likewise a closed pipe on stdout: EPIPE, reported at the flush before
     * the commit (outputs_commit), not a death by SIGPIPE that leaves them */
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 3; i++) sigaddset(&sa.sa_mask, handled[i]);
    for (int i = 0; i < 3; i++) {
        struct sigaction old;
        /* A signal the tool was started ignoring (nohup) stays ignored. */
        if (sigaction(handled[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN)
            sigaction(handled[i], &sa, NULL);
    }
}

/* While temporaries are created and renamed, so that the handler's list
 * and the disk agree. */
static void block_signals(bool block, sigset_t *saved) {
    if (!block) {
        sigprocmask(SIG_SETMASK, saved, NULL);
        return;
    }
    sigset_t set;
    sigemptyset(&set);
    for (int i = 0; i < 3; i++) sigaddset(&set, handled[i]);
    sigprocmask(SIG_BLOCK, &set, saved);
}

/* Folder and name of the file path would write (a symbolic link followed,
 * a dangling one to the file it would create).
 * Returns 0 or an errno value. */
static int resolve(const char *path, output *o) {
    char full[PATH_MAX], dir[PATH_MAX];
    const char *p = path;
    struct stat st;
    bool exists = false;
    if (path[0] == '\0') return ENOENT;
    if (realpath(path, full) != NULL) {
        if (stat(full, &st) != 0) return errno;
        if (S_ISDIR(st.st_mode)) return EISDIR;
        exists = true;
        p = full;
    } else if (errno != ENOENT) {
        return errno;
    } else {
        const int err = attn__dangling_link_target(path, full, sizeof full);
        if (err == 0) p = full; /* the file the link names is created */
        else if (err != ENOENT) return err;
    }
    const size_t len = strlen(p);
    if (len >= sizeof dir) return ENAMETOOLONG;
    memcpy(dir, p, len + 1);
    char *slash = strrchr(dir, '/');
    const char *name = slash != NULL ? slash + 1 : dir;
    if (name[0] == '\0' || strcmp(name, ".") == 0 || strcmp(name, "..") == 0) return EISDIR;
    if (strlen(name) > NAME_MAX) return ENAMETOOLONG;
    strcpy(o->name, name);
    if (slash == NULL)
        strcpy(dir, ".");
    else
        slash[slash == dir ? 1 : 0] = '\0'; /* "/x" is in "/" */
    o->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (o->dir_fd < 0) return errno;
    if (!exists && fstat(o->dir_fd, &st) != 0) return errno;
    /* Two outputs are one file when they share (dev, ino) of the file, or,
     * for files not there yet, of the folder and the same name. */
    o->dev = st.st_dev;
    o->ino = st.st_ino;
    o->exists = exists;
    o->in_place = exists && !S_ISREG(st.st_mode);
    return 0;
}

/* An existing file is one file under any name (links, "./", "sub/.."); a
 * new one is its folder and name. Devices and FIFOs are written in place,
 * so two outputs there both arrive (-o /dev/null --weights /dev/null). */
static bool same_file(const output *a, const output *b) {
    return !a->in_place && !b->in_place && a->exists == b->exists && a->dev == b->dev &&
           a->ino == b->ino && (a->exists || strcmp(a->name, b->name) == 0);
}

/* Whether output o would replace input file in (an existing regular file:
 * devices and FIFOs are written in place, and reading one loses nothing). */
static bool replaces(const output *o, const input *in) {
    return o->exists && !o->in_place && o->dev == in->dev && o->ino == in->ino;
}

static int refuse_over_input(const output *o, const input *in) {
    say("attn: %s '%s' is the file of %s ('%s'); outputs go to new files, an input is never "
        "overwritten\n(see attn --help)\n",
        o->option, o->path, in->option, in->path);
    return CLI_USAGE;
}

int outputs_input(const char *option, const char *path) {
    struct stat st;
    if (path == NULL || stat(path, &st) != 0 || !S_ISREG(st.st_mode))
        return CLI_OK; /* not there: reading it fails and says so */
    if (ninputs == MAX_INPUTS) {
        say("attn: more than %d input files\n", MAX_INPUTS);
        return CLI_USAGE;
    }
    input *in = &inputs[ninputs];
    *in = (input){option, path, st.st_dev, st.st_ino};
    for (int i = 0; i < count; i++)
        if (replaces(&outputs[i], in)) return refuse_over_input(&outputs[i], in);
    ninputs++;
    return CLI_OK;
}

int outputs_add(const char *option, const char *path) {
    if (count == 0) install_handlers();
    if (count == MAX_OUTPUTS) {
        say("attn: more than %d outputs\n", MAX_OUTPUTS);
        return CLI_USAGE;
    }
    output *o = &outputs[count];
    memset(o, 0, sizeof *o);
    o->option = option;
    o->path = path;
    o->dir_fd = -1;
    int err = resolve(path, o);
    if (err != 0) {
        if (o->dir_fd >= 0) close(o->dir_fd);
        say("attn: writing %s '%s': %s\n", option, path, strerror(err));
        return CLI_RUNTIME;
    }
    for (int i = 0; i < ninputs; i++) {
        if (!replaces(o, &inputs[i])) continue;
        close(o->dir_fd);
        return refuse_over_input(o, &inputs[i]);
    }
    for (int i = 0; i < count; i++) {
        if (!same_file(&outputs[i], o)) continue;
        close(o->dir_fd);
        say(
                "attn: %s and %s name the same file ('%s', '%s'); each output needs its own\n"
                "(see attn --help)\n",
                outputs[i].option, option, outputs[i].path, path);
        return CLI_USAGE;
    }
    count++;
    return CLI_OK;
}

static output *find(const char *option) {
    for (int i = 0; i < count; i++)
        if (strcmp(outputs[i].option, option) == 0) return &outputs[i];
    return NULL;
}

/* Creates ".NAME.XXXXXXXX.tmp" in the folder (O_EXCL: never an existing
 * file) and records it for the signal handler before signals can land. */
static int create_temp(output *o, int *fd) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long x = (unsigned long long)getpid() << 32 ^ (unsigned long long)ts.tv_nsec;
    sigset_t saved;
    int err = EEXIST;
    block_signals(true, &saved);
    for (int attempt = 0; attempt < 100 && err == EEXIST; attempt++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        char temp[sizeof o->temp];
        snprintf(temp, sizeof temp, ".%.200s.%08x.tmp", o->name, (unsigned)(x >> 32));
        memcpy(o->temp, temp, sizeof temp);
        *fd = openat(o->dir_fd, o->temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        err = *fd >= 0 ? 0 : errno;
    }
    if (err == 0) o->temp_exists = 1;
    block_signals(false, &saved);
    return err;
}

static const char *write_npy(int fd, const void *t) {
    return attn_npy_write_fd(fd, t) == ATTN_OK ? NULL : attn_last_error();
}

int outputs_stage(const char *option, const attn_tensor *t) {
    return outputs_stage_with(option, write_npy, t);
}

int outputs_stage_with(const char *option, output_writer write, const void *ctx) {
    output *o = find(option);
    if (o == NULL) return CLI_OK; /* not asked for */
    o->write = write;
    o->ctx = ctx;
    if (o->in_place) return CLI_OK; /* written at commit */
    int fd, err = create_temp(o, &fd);
    if (err != 0) {
        say("attn: writing %s '%s': cannot create a temporary file beside it: %s\n",
                option, o->path, strerror(err));
        return CLI_RUNTIME;
    }
    struct stat st; /* the replacement keeps the old file's owner and permission bits */
    if (o->exists && fstatat(o->dir_fd, o->name, &st, 0) == 0) {
        if (fchown(fd, st.st_uid, st.st_gid) != 0) {
            /* only root may give a file away: it stays ours */
        }
        if (fchmod(fd, st.st_mode & 0777) != 0) {
            /* our own new file: cannot fail in practice, and is no reason to stop */
        }
    }
    const char *failed = write(fd, ctx);
    if (failed == NULL && fsync(fd) != 0) err = errno; /* on disk before any rename */
    if (close(fd) != 0 && failed == NULL && err == 0) err = errno;
    if (failed != NULL || err != 0) {
        say("attn: writing %s '%s': %s\n", option, o->path,
                failed != NULL ? failed : strerror(err));
        return CLI_RUNTIME;
    }
    return CLI_OK;
}

const char *outputs_temp_name(const char *option) {
    const output *o = find(option);
    return o != NULL && o->temp_exists ? o->temp : NULL;
}

int outputs_in_place(const char *option) {
    const output *o = find(option);
    return o != NULL && o->in_place;
}

/* The name came from another process: only a temporary's name, in the
 * target's folder ("." NAME "." 8 hex digits ".tmp"), is opened. */
static bool is_temp_of(const output *o, const char *temp) {
    const size_t n = strlen(temp), name = strlen(o->name);
    return n < sizeof o->temp && strchr(temp, '/') == NULL && temp[0] == '.' && n > 14 &&
           strncmp(temp + 1, o->name, name < 200 ? name : 200) == 0 &&
           strcmp(temp + n - 4, ".tmp") == 0;
}

int outputs_open_temp(const char *option, const char *temp, int *fd) {
    output *o = find(option);
    *fd = -1;
    if (o == NULL || temp == NULL || !is_temp_of(o, temp)) {
        say("attn: writing %s '%s': '%s' is not its temporary file\n", option,
                o != NULL ? o->path : "", temp != NULL ? temp : "(none)");
        return CLI_RUNTIME;
    }
    /* Not O_CREAT: a folder that is another one here (no shared file
     * system) must fail, not receive a part of the file. */
    *fd = openat(o->dir_fd, temp, O_WRONLY | O_CLOEXEC);
    if (*fd < 0) {
        say(
                "attn: writing %s '%s': cannot open the temporary file '%s' beside it: %s "
                "(every rank must see the same folder)\n",
                option, o->path, temp, strerror(errno));
        return CLI_RUNTIME;
    }
    return CLI_OK;
}

void outputs_abort(void) {
    sigset_t saved;
    block_signals(true, &saved);
    for (int i = 0; i < count; i++) {
        output *o = &outputs[i];
        if (o->temp_exists) unlinkat(o->dir_fd, o->temp, 0);
        o->temp_exists = 0;
        if (o->dir_fd >= 0) close(o->dir_fd);
        o->dir_fd = -1;
    }
    count = 0;
    block_signals(false, &saved);
}

/* Standard output first: the command's summary line, printed before this
 * call, must have arrived (a full disk, a closed pipe), or nothing is
 * replaced (main says why). Then in-place targets (they may fail, and
 * nothing is renamed yet), then the renames, with signals held so that they
 * all happen. */
int outputs_commit(void) {
    if (fflush(stdout) != 0 || ferror(stdout)) {
        outputs_abort();
        return CLI_RUNTIME;
    }
    for (int i = 0; i < count; i++) {
        output *o = &outputs[i];
        if (!o->in_place || o->write == NULL) continue;
        int fd;
        const int err = attn__open_in_place(o->path, &fd);
        const char *failed = err != 0 ? attn__in_place_error(o->path, err) : o->write(fd, o->ctx);
        if (failed != NULL) {
            say("attn: writing %s '%s': %s\n", o->option, o->path, failed);
            if (fd >= 0) close(fd);
            outputs_abort();
            return CLI_RUNTIME;
        }
        close(fd);
    }
    sigset_t saved;
    block_signals(true, &saved);
    int rc = CLI_OK;
    for (int i = 0; i < count && rc == CLI_OK; i++) {
        output *o = &outputs[i];
        if (!o->temp_exists) continue;
        if (renameat(o->dir_fd, o->temp, o->dir_fd, o->name) != 0) {
            say("attn: writing %s '%s': cannot rename the temporary file over it: %s\n",
                    o->option, o->path, strerror(errno));
            rc = CLI_RUNTIME;
            break;
        }
        o->temp_exists = 0;
        (void)fsync(o->dir_fd); /* the rename, durable; some file systems refuse */
    }
    block_signals(false, &saved);
    outputs_abort(); /* removes what a failed rename left; closes the folders */
    return rc;
}
