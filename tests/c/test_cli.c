/*
 * test_cli.c — the attn tool as a user runs it: the demo's numbers, sdpa on
 * .npy files (compared with the library), --help/--version, and exit codes
 * 0 / 1 / 2 with the library's message on stderr.
 */
#define _POSIX_C_SOURCE 200809L /* popen, mkdtemp */
#include <stdio.h>
#include <sys/wait.h>

#include "testutil.h"

#ifndef ATTN_CLI
#error "ATTN_CLI must name the attn executable"
#endif

static char dir[64];

/* Runs `attn <args>`, capturing stdout+stderr into buf; returns the exit code. */
static int run(const char *args, char *buf, size_t size) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cd %s && '%s' %s 2>&1", dir, ATTN_CLI, args);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(buf, 1, size - 1, p) : 0;
    buf[n] = '\0';
    int status = p ? pclose(p) : -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
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
    int rc = run("sdpa -q q.npy -k k.npy -v v.npy --mask m.npy --causal=bottom-right --gqa "
                 "--scale -0.25 --dropout 0.2 --seed 17 -o o.npy --weights w.npy --lse l.npy "
                 "--threads 2",
                 log, sizeof log);
    CHECK(rc == 0, "sdpa exited %d:\n%s", rc, log);
    CHECK(strstr(log, "sdpa: q(2, 4, 5, 8) k(2, 2, 7, 8) v(2, 2, 7, 3) -> out(2, 4, 5, 3)") != NULL,
          "summary line: %s", log);
    const char *names[3] = {"o.npy", "w.npy", "l.npy"};
    test_tensor *want[3] = {&o, &w, &l};
    for (int i = 0; i < 3; i++) {
        char path[256];
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
    /* Default output name. */
    CHECK(run("sdpa -q q.npy -k k.npy -v v.npy --gqa --causal", log, sizeof log) == 0, "%s", log);
    CHECK(strstr(log, "-> out.npy") != NULL, "default -o is out.npy: %s", log);
    test_tensor *all[] = {&q, &k, &v, &m, &o, &w, &l};
    for (int i = 0; i < 7; i++) tt_free(all[i]);
}

static void exit_codes(void) {
    static char log[8192];
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
        {"sdpa -q q.npy -k k.npy -v v.npy --frobnicate", 2, "unknown option"},
        {"sdpa -q q.npy -k k.npy -v v.npy --scale abc", 2, "--scale"},
        {"sdpa -q q.npy -k k.npy -v v.npy --dropout 0.5", 2, "--seed"},
        {"sdpa -q q.npy -k k.npy -v v.npy --dropout 2 --seed 1", 2, "probability"},
        {"sdpa -q q.npy -k k.npy -v v.npy --threads 0", 2, "--threads"},
        {"sdpa -q q.npy -k k.npy -v", 2, "needs a value"},
        {"sdpa -q missing.npy -k k.npy -v v.npy", 1, "missing.npy"},
        {"sdpa -q q.npy -k k.npy -v v.npy", 1, "enable_gqa"}, /* 4 vs 2 heads without --gqa */
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa --mask q.npy", 1, "attn_mask"},
        {"sdpa -q m.npy -k k.npy -v v.npy", 1, "float32 or float64"},
        {"sdpa -q q.npy -k k.npy -v v.npy --gqa -o /nonexistent/o.npy", 1, "/nonexistent/o.npy"},
        {"demo extra", 2, "no arguments"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = run(cases[i].args, log, sizeof log);
        CHECK(rc == cases[i].code, "attn %s exited %d, expected %d:\n%s", cases[i].args, rc,
              cases[i].code, log);
        CHECK(strstr(log, cases[i].needle) != NULL, "attn %s: message lacks '%s':\n%s",
              cases[i].args, cases[i].needle, log);
    }
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
    /* A malformed .npy is a runtime error with the parser's message. */
    char path[256];
    snprintf(path, sizeof path, "%s/bad.npy", dir);
    FILE *f = fopen(path, "wb");
    static const char bad[] = "\x93NUMPY\x01\x00\x10\x00{'descr': '<f4'";
    fwrite(bad, 1, sizeof bad - 1, f);
    fclose(f);
    int rc = run("sdpa -q bad.npy -k k.npy -v v.npy", log, sizeof log);
    CHECK(rc == 1 && strstr(log, "bad.npy") && strstr(log, "truncated"), "bad.npy: %d %s", rc, log);
}

int main(int argc, char **argv) {
    snprintf(dir, sizeof dir, "/tmp/attn_cli_XXXXXX");
    if (mkdtemp(dir) == NULL) return 1;
    static const harness_test tests[] = {T(demo), T(sdpa_on_files), T(exit_codes)};
    int rc = harness_main(argc, argv, tests, 3);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
