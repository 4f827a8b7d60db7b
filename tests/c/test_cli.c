/*
 * test_cli.c — the attn tool as a user runs it: the demo's numbers, sdpa on
 * .npy files and mha with safetensors weights (compared with the library),
 * --help/--version, and exit codes
 * 0 / 1 / 2 with the library's message on stderr.
 */
#define _GNU_SOURCE /* popen, mkdtemp, symlink, RLIMIT_FSIZE, mount */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/mount.h>
#endif

#include "testutil.h"

#ifndef ATTN_CLI
#error "ATTN_CLI must name the attn executable"
#endif

static char dir[64];

/* Runs `attn <args>`, capturing stdout+stderr into buf; returns the exit code. */
/* The output of popen'd `p` into buf (size - 1 bytes at most), the rest
 * read and dropped: closing the pipe early would kill a long output's writer
 * with SIGPIPE (exit 141). Returns the exit code. */
static int collect(FILE *p, char *buf, size_t size) {
    size_t n = p ? fread(buf, 1, size - 1, p) : 0;
    buf[n] = '\0';
    char rest[4096];
    while (p && fread(rest, 1, sizeof rest, p) > 0) continue;
    int status = p ? pclose(p) : -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static int run(const char *args, char *buf, size_t size) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cd %s && '%s' %s 2>&1", dir, ATTN_CLI, args);
    return collect(popen(cmd, "r"), buf, size);
}

/* The same with stdout going to /dev/full (every write fails with ENOSPC);
 * buf gets stderr. */
static int run_to_full(const char *args, char *buf, size_t size) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cd %s && '%s' %s 2>&1 >/dev/full", dir, ATTN_CLI, args);
    return collect(popen(cmd, "r"), buf, size);
}

static int count(const char *hay, const char *needle) {
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)) != NULL; p++) n++;
    return n;
}

static void demo(void) {
    static char out[65536];
    CHECK(run("", out, sizeof out) == 0, "attn exits non-zero:\n%s", out);
    const char *matrix = "[[3.9492, 7.8588, 3.9577],\n"
                         "    [3.9924, 7.9784, 3.9934],\n"
                         "    [3.8407, 7.5669, 3.8595],\n"
                         "    [3.7902, 7.4482, 3.8228]]";
    CHECK(count(out, matrix) == 2, "the seed matrix appears %d times, expected 2 (both layouts)",
          count(out, matrix));
    CHECK(strstr(out, "SDPA: Q(3, 30, 128) K(3, 50, 128) V(3, 50, 256) => out(3, 30, 256) "
                      "attention(3, 30, 50)") != NULL,
          "seed 000 SDPA shapes missing");
    CHECK(strstr(out, "src(128, 32, 200) => out(128, 32, 200) attention(128, 5, 32, 32)") != NULL,
          "seed 000 MHA shapes missing");
    CHECK(strstr(out, "not divisible by num_heads 6") != NULL, "200/6 explanation missing");
    static char again[65536];
    CHECK(run("demo", again, sizeof again) == 0 && strcmp(out, again) == 0,
          "'attn demo' differs from 'attn'");
}

static void save(const char *name, attn_tensor *t) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    CHECK_OK(attn_npy_save(path, t));
}

static void sdpa_on_files(void) {
    rng r = {harness_seed() ^ 0x7777};
    int64_t qs[4] = {2, 4, 5, 8}, ks[4] = {2, 2, 7, 8}, vs[4] = {2, 2, 7, 3}, ms[2] = {5, 7},
            os[4] = {2, 4, 5, 3}, ws[4] = {2, 4, 5, 7};
    test_tensor q, k, v, m, o, w, l;
    tt_make(&q, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&k, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&v, &r, ATTN_DTYPE_F32, 4, vs, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&m, &r, ATTN_DTYPE_BOOL, 2, ms, LAYOUT_CONTIGUOUS, 1, 0.7);
    tt_make_output(&o, &r, ATTN_DTYPE_F32, 4, os, LAYOUT_CONTIGUOUS);
    tt_make_output(&w, &r, ATTN_DTYPE_F32, 4, ws, LAYOUT_CONTIGUOUS);
    tt_make_output(&l, &r, ATTN_DTYPE_F32, 3, os, LAYOUT_CONTIGUOUS);
    save("q.npy", &q.t);
    save("k.npy", &k.t);
    save("v.npy", &v.t);
    save("m.npy", &m.t);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.attn_mask = &m.t;
    p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    p.enable_gqa = 1;
    p.has_scale = 1;
    p.scale = -0.25;
    p.dropout_p = 0.2;
    p.seed = 17;
    CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, &p, &o.t, &w.t, &l.t));
    static char log[8192];
    char args[512];
    snprintf(args, sizeof args,
             "sdpa -q q.npy -k k.npy -v v.npy --mask m.npy --causal=bottom-right --gqa "
             "--scale -0.25 --dropout 0.2 --seed 17 -o o.npy --weights w.npy --lse l.npy "
             "--threads %d", /* 1 in a build without OpenMP */
             attn_max_threads() < 2 ? 1 : 2);
    int rc = run(args, log, sizeof log);
    CHECK(rc == 0, "sdpa exited %d:\n%s", rc, log);
    CHECK(strstr(log, "sdpa: q(2, 4, 5, 8) k(2, 2, 7, 8) v(2, 2, 7, 3) -> out(2, 4, 5, 3)") != NULL,
          "summary line: %s", log);
    const char *names[3] = {"o.npy", "w.npy", "l.npy"};
    test_tensor *want[3] = {&o, &w, &l};
    char path[256];
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        attn_tensor got;
        CHECK_OK(attn_npy_load(path, &got));
        if (got.data) {
            CHECK(attn_tensor_numel(&got) == attn_tensor_numel(&want[i]->t), "%s size", names[i]);
            CHECK(memcmp(got.data, want[i]->t.data,
                         sizeof(float) * (size_t)attn_tensor_numel(&got)) == 0,
                  "%s differs from the library's result", names[i]);
        }
        attn_npy_free(&got);
    }
    /* Issue 9: without -o the tool silently wrote ./out.npy. */
    rc = run("sdpa -q q.npy -k k.npy -v v.npy --gqa --causal", log, sizeof log);
    CHECK(rc == 2 && strstr(log, "-o") != NULL, "no -o: %d %s", rc, log);
    snprintf(path, sizeof path, "%s/out.npy", dir);
    CHECK(access(path, F_OK) != 0, "out.npy was written");
    test_tensor *all[] = {&q, &k, &v, &m, &o, &w, &l};
    for (int i = 0; i < 7; i++) tt_free(all[i]);
}

/* `attn mha`: the module's parameters saved under torch's names (prefix
 * "m.", kdim/vdim, bias_kv) or BERT's (packed rows split into query, key,
 * value), run by the tool, equal the library's attn_mha_forward bit for bit. */
static void mha_run_case(bool bert) {
    rng r = {harness_seed() ^ (bert ? 0xbe27 : 0x70c4)};
    attn_mha_config c;
    attn_mha_config_init(&c, 8, 2);
    if (!bert) {
        c.kdim = 5;
        c.vdim = 6;
        c.add_bias_kv = 1;
        c.batch_first = 1;
    }
    c.init_seed = 3;
    attn_mha *m = NULL;
    CHECK_OK(attn_mha_create(&c, &m));
    if (m == NULL) return;
    const char *names[8];
    char storage[8][64];
    attn_tensor ts[8];
    int n = 0;
    for (int i = 0; i < attn_mha_param_count(m); i++) {
        const char *pname;
        attn_tensor view;
        CHECK_OK(attn_mha_param_at(m, i, &pname, &view));
        for (int part = 0; part < (bert && strncmp(pname, "in_proj", 7) == 0 ? 3 : 1); part++) {
            static const char *const lin[3] = {"self.query", "self.key", "self.value"};
            const bool w = strcmp(pname, "in_proj_weight") == 0;
            if (bert && strncmp(pname, "in_proj", 7) == 0) {
                snprintf(storage[n], sizeof storage[n], "enc.%s.%s", lin[part], w ? "weight" : "bias");
                view.shape[0] = 8; /* one of the three row blocks */
                if (part > 0) view.data = (char *)ts[n - 1].data + 8 * (w ? 8 : 1) * sizeof(float);
            } else {
                snprintf(storage[n], sizeof storage[n], "%s%s", bert ? "enc." : "m.",
                         !bert ? pname
                         : strcmp(pname, "out_proj.weight") == 0 ? "output.dense.weight"
                                                                 : "output.dense.bias");
            }
            names[n] = storage[n];
            ts[n++] = view;
        }
    }
    char path[256];
    snprintf(path, sizeof path, "%s/m.safetensors", dir);
    CHECK_OK(attn_safetensors_save(path, (size_t)n, names, ts, NULL));
    int64_t qs[3] = {3, 4, 8}, ks[3] = {3, 6, 5}, vs[3] = {3, 6, 6};
    test_tensor q, k, v, o;
    tt_make(&q, &r, ATTN_DTYPE_F32, 3, qs, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&k, &r, ATTN_DTYPE_F32, 3, ks, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&v, &r, ATTN_DTYPE_F32, 3, vs, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make_output(&o, &r, ATTN_DTYPE_F32, 3, qs, LAYOUT_CONTIGUOUS);
    save("mq.npy", &q.t);
    save("mk.npy", &k.t);
    save("mv.npy", &v.t);
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    fp.is_causal = !bert;
    CHECK_OK(attn_mha_forward(m, &q.t, bert ? &q.t : &k.t, bert ? &q.t : &v.t, &fp, &o.t, NULL));
    static char log[8192];
    const char *args = bert ? "mha --weights m.safetensors --prefix enc. --num-heads 2 -q mq.npy "
                              "-o mo.npy"
                            : "mha --weights m.safetensors --prefix m. --num-heads 2 -q mq.npy "
                              "-k mk.npy -v mv.npy --causal --batch-first -o mo.npy";
    int rc = run(args, log, sizeof log);
    CHECK(rc == 0, "mha exited %d:\n%s", rc, log);
    CHECK(strstr(log, bert ? "BERT weights under 'enc.'" : "torch weights under 'm.'") != NULL,
          "summary line: %s", log);
    snprintf(path, sizeof path, "%s/mo.npy", dir);
    attn_tensor got;
    CHECK_OK(attn_npy_load(path, &got));
    CHECK(got.data && attn_tensor_numel(&got) == 96 && memcmp(got.data, o.t.data, 96 * 4) == 0,
          "%s: the tool's output differs from attn_mha_forward's", bert ? "BERT" : "torch");
    attn_npy_free(&got);
    test_tensor *all[] = {&q, &k, &v, &o};
    for (int i = 0; i < 4; i++) tt_free(all[i]);
    attn_mha_destroy(m);
}

static void mha_on_files(void) {
    mha_run_case(false);
    mha_run_case(true);
    static char log[8192];
    CHECK(run("mha --help", log, sizeof log) == 0 && strstr(log, "--num-heads") != NULL,
          "mha --help: %s", log);
    int rc = run("mha --weights m.safetensors -q mq.npy -o x.npy", log, sizeof log);
    CHECK(rc == 2 && strstr(log, "--num-heads") != NULL, "no --num-heads: %d %s", rc, log);
    rc = run("mha --weights m.safetensors --prefix nope. --num-heads 2 -q mq.npy -o x.npy", log,
             sizeof log);
    CHECK(rc == 1 && strstr(log, "no attention weights under the prefix 'nope.'") != NULL,
          "wrong prefix: %d %s", rc, log);
}

static void exit_codes(void) {
    static char log[8192];
    char sub[128], link[128];
    snprintf(sub, sizeof sub, "%s/sub", dir);
    snprintf(link, sizeof link, "%s/link.npy", dir);
    CHECK(mkdir(sub, 0700) == 0 && symlink("o.npy", link) == 0, "setup");
    CHECK(run("--help", log, sizeof log) == 0 && strstr(log, "usage: attn") != NULL, "--help");
    CHECK(run("--version", log, sizeof log) == 0 && strstr(log, ATTN_VERSION_STRING) != NULL,
          "--version");
    CHECK(run("info", log, sizeof log) == 0 && strstr(log, "kernel path") != NULL, "info");
    struct {
        const char *args;
        int code;
        const char *needle;
    } cases[] = {
        {"bogus", 2, "unknown command"},
        {"sdpa -q q.npy -k k.npy", 2, "required"},
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy --frobnicate", 2, "unknown option"},
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy --scale abc", 2, "--scale"},
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy --dropout 0.5", 2, "--seed"},
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy --dropout 2 --seed 1", 2, "probability"},
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy --threads 0", 2, "--threads"},
        {"sdpa -q q.npy -k k.npy -v", 2, "needs a value"},
        {"sdpa -q missing.npy -k k.npy -v v.npy -o o.npy", 1, "missing.npy"},
        /* 4 vs 2 heads without --gqa */
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy", 1, "enable_gqa"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa --mask q.npy -o o.npy", 1, "attn_mask"},
        {"sdpa -q m.npy -k k.npy -v v.npy -o o.npy", 1, "float32, float64, float16 or bfloat16"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o /nonexistent/o.npy", 1, "/nonexistent/o.npy"},
        {"demo extra", 2, "no arguments"},
        /* Issue 9: two outputs to one file kept only the last. */
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o same.npy --weights same.npy", 2,
         "-o and --weights"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o x.npy --lse sub/../x.npy", 2,
         "-o and --lse"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --weights link.npy", 2,
         "-o and --weights"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --weights w.npy --lse ./w.npy", 2,
         "--weights and --lse"},
        /* Issue 9: messages that named the wrong thing, values refused or
         * taken wrongly. */
        {"info extra", 2, "info takes no arguments"},
        {"sdpa --help", 0, "usage: attn sdpa"},
        {"sdpa -q q.npy -h", 0, "-o OUT.npy"},
        {"help", 0, "usage: attn"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --scale 1e-310", 0, "-> o.npy"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --dropout 1e-320 --seed 1", 0,
         "-> o.npy"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --scale 0", 0, "-> o.npy"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --scale 1e-400", 2, "--scale"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --scale -1e400", 2, "--scale"},
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy --dropout 0.1 --seed ' -1'", 2, "--seed"},
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy --dropout 0.1 --seed '\t-1'", 2, "--seed"},
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy --dropout 0.1 --seed -0", 2, "--seed"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --dropout 0.1 "
         "--seed 18446744073709551615", 0, "-> o.npy"},
        {"sdpa -q q.npy -k k.npy -v v.npy -o o.npy --threads ' -1'", 2, "--threads"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = run(cases[i].args, log, sizeof log);
        CHECK(rc == cases[i].code, "attn %s exited %d, expected %d:\n%s", cases[i].args, rc,
              cases[i].code, log);
        CHECK(strstr(log, cases[i].needle) != NULL, "attn %s: message lacks '%s':\n%s",
              cases[i].args, cases[i].needle, log);
    }
    /* A dangling link names the file it would create: -o through it writes
     * that file (the link stays), and the same file under its own name as a
     * second output is the same file. */
    char dangling[128], created[128];
    snprintf(dangling, sizeof dangling, "%s/dangling.npy", dir);
    snprintf(created, sizeof created, "%s/created.npy", dir);
    CHECK(symlink("created.npy", dangling) == 0, "symlink");
    int rcd = run("sdpa -q q.npy -k k.npy -v v.npy --gqa -o created.npy --lse dangling.npy", log,
                  sizeof log);
    CHECK(rcd == 2 && strstr(log, "-o and --lse"), "one file through a dangling link: %d %s",
          rcd, log);
    rcd = run("sdpa -q q.npy -k k.npy -v v.npy --gqa -o dangling.npy", log, sizeof log);
    struct stat lst, cst;
    CHECK(rcd == 0 && lstat(dangling, &lst) == 0 && S_ISLNK(lst.st_mode) &&
              stat(created, &cst) == 0 && S_ISREG(cst.st_mode) && cst.st_size > 128,
          "-o through a dangling link: %d %s", rcd, log);
    /* Issue 9: a 0-d input was reported as "rank 1", the shape it loads as. */
    char scalar[512];
    size_t n = 0;
    snprintf(scalar, sizeof scalar, "%s/npy/f64_scalar.npy", ATTN_TEST_DATA);
    unsigned char *bytes = tt_read_file(scalar, &n);
    snprintf(scalar, sizeof scalar, "%s/scalar.npy", dir);
    CHECK(bytes != NULL && tt_write_file(scalar, bytes, n) == 0, "copying f64_scalar.npy");
    free(bytes);
    int rc0 = run("sdpa -q scalar.npy -k k.npy -v v.npy -o o.npy", log, sizeof log);
    CHECK(rc0 == 1 && strstr(log, "-q") && strstr(log, "rank 0") && !strstr(log, "rank 1"),
          "0-d -q: %d %s", rc0, log);
    /* Issue 9: --threads above attn_max_threads() was clamped silently. */
    char args[256], bound[32];
    snprintf(args, sizeof args, "sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --threads %d",
             attn_max_threads() + 1);
    snprintf(bound, sizeof bound, "%d", attn_max_threads());
    rc0 = run(args, log, sizeof log);
    CHECK(rc0 == 2 && strstr(log, "--threads") && strstr(log, bound), "--threads max+1: %d %s",
          rc0, log);
    snprintf(args, sizeof args, "sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy --threads %d",
             attn_max_threads());
    CHECK(run(args, log, sizeof log) == 0, "--threads max: %s", log);
    /* Issue 9: a failed write to stdout exited 0. */
    const char *to_full[] = {"info", "--help", "--version", "sdpa --help",
                             "sdpa -q q.npy -k k.npy -v v.npy --gqa -o o.npy"};
    for (int i = 0; i < 5; i++) {
        rc0 = run_to_full(to_full[i], log, sizeof log);
        CHECK(rc0 == 1 && strstr(log, "standard output") && strstr(log, strerror(ENOSPC)),
              "attn %s >/dev/full: exit %d, stderr: %s", to_full[i], rc0, log);
    }
    /* A malformed .npy is a runtime error with the parser's message. */
    char path[256];
    snprintf(path, sizeof path, "%s/bad.npy", dir);
    FILE *f = fopen(path, "wb");
    static const char bad[] = "\x93NUMPY\x01\x00\x10\x00{'descr': '<f4'";
    fwrite(bad, 1, sizeof bad - 1, f);
    fclose(f);
    int rc = run("sdpa -q bad.npy -k k.npy -v v.npy -o o.npy", log, sizeof log);
    CHECK(rc == 1 && strstr(log, "bad.npy") && strstr(log, "truncated"), "bad.npy: %d %s", rc, log);
}

/* ---- what a failed or interrupted run leaves on disk ---- */

/* Starts `attn args...` in folder cwd with stdout and stderr in log_path.
 * fsize_limit > 0 caps the size of files it writes (EFBIG, as a full disk
 * gives ENOSPC). */
static pid_t spawn(const char *cwd, const char *const *args, long fsize_limit,
                   const char *log_path) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid != 0) return pid;
    int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (chdir(cwd) != 0 || fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(126);
    /* The test's own dispositions must not leak in (a shell may ignore SIGINT). */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    if (fsize_limit > 0) { /* SIGXFSZ left as it is: the tool must not die of it */
        struct rlimit lim = {(rlim_t)fsize_limit, (rlim_t)fsize_limit};
        signal(SIGXFSZ, SIG_DFL);
        setrlimit(RLIMIT_FSIZE, &lim);
    }
    char *argv[32] = {(char *)ATTN_CLI};
    for (int i = 0; args[i] != NULL && i < 30; i++) argv[i + 1] = (char *)args[i];
    execv(ATTN_CLI, argv);
    _exit(127);
}

/* The exit code, or -signal when it died of one. */
static int wait_for(pid_t pid) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? -WTERMSIG(status) : -999;
}

static void save_vector(const char *path, attn_dtype dtype, int64_t L, int64_t E, rng *r) {
    const int64_t shape[4] = {1, 1, L, E};
    test_tensor x;
    tt_make(&x, r, dtype, 4, shape, LAYOUT_CONTIGUOUS, 1, 0);
    CHECK_OK(attn_npy_save(path, &x.t));
    tt_free(&x);
}

/* Both files hold what they held before, and the folder holds only them. */
static void check_untouched(const char *folder, const char *what) {
    char names[512], path[256];
    const char *old[2] = {"old o", "old w"}, *name[2] = {"o.npy", "w.npy"};
    for (int i = 0; i < 2; i++) {
        size_t n = 0;
        snprintf(path, sizeof path, "%s/%s", folder, name[i]);
        unsigned char *now = tt_read_file(path, &n);
        CHECK(now != NULL && n == 5 && memcmp(now, old[i], 5) == 0,
              "%s: %s changed (%zu bytes now)", what, name[i], n);
        free(now);
    }
    CHECK(tt_list_dir(folder, names, sizeof names) == 2 && strcmp(names, "o.npy w.npy") == 0,
          "%s: the folder holds %s", what, names);
}

static void make_old_outputs(const char *folder) {
    char path[256];
    snprintf(path, sizeof path, "%s/o.npy", folder);
    CHECK(tt_write_file(path, "old o", 5) == 0, "writing %s", path);
    snprintf(path, sizeof path, "%s/w.npy", folder);
    CHECK(tt_write_file(path, "old w", 5) == 0, "writing %s", path);
}

/* Issue 9: outputs were written one at a time, in place. A full disk left a
 * truncated --weights; -o was already replaced when --weights failed. Now
 * every output goes to a temporary first and none is renamed unless all are
 * complete. The full disk is a 64 KiB tmpfs when the test may mount one,
 * and always a 64 KiB file-size limit (EFBIG). */
static void failed_run_writes_nothing(void) {
    rng r = {harness_seed() ^ 0x3131};
    char folder[128], path[256], log_path[128];
    snprintf(path, sizeof path, "%s/fq.npy", dir);
    save_vector(path, ATTN_DTYPE_F32, 160, 4, &r); /* weights (1, 1, 160, 160): 100 KiB */
    snprintf(path, sizeof path, "%s/fv.npy", dir);
    save_vector(path, ATTN_DTYPE_F32, 160, 2, &r); /* out: 1.4 KiB */
    snprintf(folder, sizeof folder, "%s/full", dir);
    snprintf(log_path, sizeof log_path, "%s/full.log", dir);
    const char *args[] = {"sdpa", "-q", "../fq.npy", "-k", "../fq.npy", "-v", "../fv.npy",
                          "-o", "o.npy", "--weights", "w.npy", NULL};
    for (int variant = 0; variant < 2; variant++) {
        CHECK(mkdir(folder, 0700) == 0, "mkdir %s", folder);
        bool mounted = false;
#ifdef __linux__
        if (variant == 0) mounted = mount("tmpfs", folder, "tmpfs", 0, "size=64k") == 0;
#endif
        if (variant == 0 && !mounted) {
            printf("  a 64 KiB tmpfs: skipped, cannot mount (%s)\n", strerror(errno));
            rmdir(folder);
            continue;
        }
        make_old_outputs(folder);
        int rc = wait_for(spawn(folder, args, mounted ? 0 : 64 * 1024, log_path));
        size_t n = 0;
        char *log = (char *)tt_read_file(log_path, &n);
        const char *reason = strerror(mounted ? ENOSPC : EFBIG);
        CHECK(rc == 1 && log && strstr(log, "--weights") && strstr(log, reason),
              "%s: exit %d, log: %.*s", reason, rc, (int)n, log ? log : "");
        free(log);
        check_untouched(folder, reason);
#ifdef __linux__
        if (mounted) CHECK(umount(folder) == 0, "umount %s: %s", folder, strerror(errno));
#endif
        tt_remove_tree(folder);
    }
    /* An output whose folder is missing fails before anything is written. */
    static char log[8192];
    int rc = run("sdpa -q fq.npy -k fq.npy -v fv.npy -o fo.npy --weights nodir/w.npy", log,
                 sizeof log);
    CHECK(rc == 1 && strstr(log, "--weights") && strstr(log, "nodir/w.npy") &&
              strstr(log, strerror(ENOENT)),
          "nodir: %d %s", rc, log);
    snprintf(path, sizeof path, "%s/fo.npy", dir);
    CHECK(access(path, F_OK) != 0, "fo.npy written though the run failed");
    /* An output over an input file (or a link to it) is refused before any
     * work: the run would replace what it reads. */
    snprintf(path, sizeof path, "%s/fq.npy", dir);
    size_t before_n = 0, after_n = 0;
    unsigned char *before = tt_read_file(path, &before_n);
    char link[256];
    snprintf(link, sizeof link, "%s/fq_link.npy", dir);
    CHECK(symlink("fq.npy", link) == 0, "symlink");
    const char *over_inputs[][2] = {
        {"sdpa -q fq.npy -k fq.npy -v fv.npy -o fq.npy", "-o 'fq.npy' is the file of -q"},
        {"sdpa -q fq.npy -k fq.npy -v fv.npy -o fo.npy --lse fq_link.npy", "--lse"},
        {"sdpa -q fq.npy -k fq.npy -v fv.npy -o ./fv.npy", "is the file of -v"},
    };
    for (size_t i = 0; i < sizeof over_inputs / sizeof over_inputs[0]; i++) {
        rc = run(over_inputs[i][0], log, sizeof log);
        CHECK(rc == 2 && strstr(log, over_inputs[i][1]) && strstr(log, "never overwritten"),
              "%s: %d %s", over_inputs[i][0], rc, log);
    }
    unsigned char *after = tt_read_file(path, &after_n);
    CHECK(before && after && before_n == after_n && memcmp(before, after, before_n) == 0,
          "fq.npy (-q and -o) changed");
    free(before);
    free(after);
    /* A FIFO with no writer is refused at once, not waited on forever
     * (the harness's timeout would catch a hang). */
    snprintf(path, sizeof path, "%s/fifo.npy", dir);
    CHECK(mkfifo(path, 0600) == 0, "mkfifo");
    rc = run("sdpa -q fifo.npy -k fq.npy -v fv.npy -o fo.npy", log, sizeof log);
    CHECK(rc == 1 && strstr(log, "fifo.npy") && strstr(log, "not a regular file"), "fifo: %d %s",
          rc, log);
    /* A FIFO output that no process reads: refused after a bounded wait
     * for a reader (5 s), where open(2) had waited for good. */
    rc = run("sdpa -q fq.npy -k fq.npy -v fv.npy -o fifo.npy", log, sizeof log);
    CHECK(rc == 1 && strstr(log, "'fifo.npy': a FIFO that no process opened for reading"),
          "fifo output: %d %s", rc, log);
}

/* Issue 9: SIGINT/SIGTERM during a large --weights write left a file whose
 * header promised more than it held. The signal must leave no output and
 * no temporary: the tool removes its temporaries, then dies of the signal. */
static void signal_during_write_leaves_nothing(void) {
    rng r = {harness_seed() ^ 0x5151};
    char folder[128], path[256], log_path[128];
    snprintf(path, sizeof path, "%s/sq.npy", dir);
    save_vector(path, ATTN_DTYPE_F64, 4096, 1, &r); /* weights: 4096 x 4096 float64, 128 MiB */
    snprintf(folder, sizeof folder, "%s/sig", dir);
    snprintf(log_path, sizeof log_path, "%s/sig.log", dir);
    const char *args[] = {"sdpa", "-q", "../sq.npy", "-k", "../sq.npy", "-v", "../sq.npy",
                          "-o", "o.npy", "--weights", "w.npy", NULL};
    const int sigs[2] = {SIGTERM, SIGINT};
    for (int i = 0; i < 2; i++) {
        CHECK(mkdir(folder, 0700) == 0, "mkdir %s", folder);
        make_old_outputs(folder);
        pid_t pid = spawn(folder, args, 0, log_path);
        /* Signal once some file in the folder has passed 1 MiB: the
         * weights are being written. */
        bool sent = false, ended = false;
        int status = 0;
        const time_t deadline = time(NULL) + 120;
        while (!sent && !ended && time(NULL) < deadline) {
            ended = waitpid(pid, &status, WNOHANG) == pid;
            DIR *d = opendir(folder);
            for (struct dirent *e; d != NULL && !sent && (e = readdir(d)) != NULL;) {
                struct stat st;
                char entry[512];
                snprintf(entry, sizeof entry, "%s/%s", folder, e->d_name);
                if (!ended && stat(entry, &st) == 0 && S_ISREG(st.st_mode) &&
                    st.st_size > (1 << 20))
                    sent = kill(pid, sigs[i]) == 0;
            }
            if (d != NULL) closedir(d);
            nanosleep(&(struct timespec){0, 500000}, NULL);
        }
        if (!ended && !sent) kill(pid, SIGKILL);
        int rc = ended ? (WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status))
                       : wait_for(pid);
        CHECK(sent && rc == -sigs[i], "signal %d: sent %d, the tool ended with %d", sigs[i], sent,
              rc);
        check_untouched(folder, strsignal(sigs[i]));
        tt_remove_tree(folder);
    }
}

/* Issue 9: messages were cut at 512 bytes, so a long path hid the reason.
 * A 4000-byte path (nested folders) must show with its reason, and one
 * longer than PATH_MAX must still name its reason. */
static void long_paths_keep_the_reason(void) {
    static char rel[4200], full[4300], arg[12000], log_path[128];
    size_t used = (size_t)snprintf(rel, sizeof rel, "long");
    for (;;) { /* rel: long/000...0/000...0/..., about 4000 bytes */
        snprintf(full, sizeof full, "%s/%s", dir, rel);
        CHECK(mkdir(full, 0700) == 0, "mkdir: %s", strerror(errno));
        if (used > 3900) break;
        used += (size_t)snprintf(rel + used, sizeof rel - used, "/%0100d", 0);
    }
    snprintf(arg, sizeof arg, "%s/bad.npy", full);
    CHECK(tt_write_file(arg, "\x93NUMPY\x01\x00\x10\x00{", 11) == 0, "writing bad.npy");
    snprintf(log_path, sizeof log_path, "%s/long.log", dir);
    struct {
        const char *option, *name, *reason;
    } cases[] = {
        {"-q", "/bad.npy", "truncated"},
        {"-o", "/nodir/o.npy", NULL}, /* strerror(ENOENT) */
        {"-o", NULL, NULL},           /* a 9000-byte name: strerror(ENAMETOOLONG) */
    };
    for (int i = 0; i < 3; i++) {
        if (cases[i].name != NULL) {
            snprintf(arg, sizeof arg, "%s%s", rel, cases[i].name);
        } else {
            memset(arg, 'a', 9000);
            arg[9000] = '\0';
        }
        const char *reason = cases[i].reason ? cases[i].reason
                             : cases[i].name ? strerror(ENOENT)
                                             : strerror(ENAMETOOLONG);
        const char *args[] = {"sdpa", "-q", i == 0 ? arg : "q.npy", "-k", "k.npy", "-v", "v.npy",
                              "--gqa", "-o", i == 0 ? "o.npy" : arg, NULL};
        int rc = wait_for(spawn(dir, args, 0, log_path));
        size_t n = 0;
        char *log = (char *)tt_read_file(log_path, &n);
        CHECK(rc == 1 && log && strstr(log, reason) && strstr(log, cases[i].option),
              "%s %zu-byte path: exit %d, %zu bytes of stderr, the last: %s", cases[i].option,
              strlen(arg), rc, n, log && n > 100 ? log + n - 100 : log ? log : "");
        if (cases[i].name != NULL)
            CHECK(log && strstr(log, arg), "%s: stderr lacks the whole path", cases[i].option);
        free(log);
    }
}

int main(int argc, char **argv) {
    snprintf(dir, sizeof dir, "/tmp/attn_cli_XXXXXX");
    if (mkdtemp(dir) == NULL) return 1;
    static const harness_test tests[] = {T(demo), T(sdpa_on_files), T(mha_on_files),
                                         T(exit_codes),
                                         T(failed_run_writes_nothing),
                                         T(signal_during_write_leaves_nothing),
                                         T(long_paths_keep_the_reason)};
    int rc = harness_main(argc, argv, tests, (int)(sizeof tests / sizeof tests[0]));
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
