/* harness.c — the test runner behind harness.h. */
#include "harness.h"

int harness_checks, harness_failures;

unsigned long long harness_seed(void) {
    const char *env = getenv("ATTN_TEST_SEED");
    unsigned long long seed = env ? strtoull(env, NULL, 0) : 20261122ull;
    return seed ? seed : 1;
}

int harness_main(int argc, char **argv, const harness_test *tests, int count) {
    int ran = 0;
    for (int i = 0; i < count; i++) {
        bool wanted = argc < 2;
        for (int a = 1; a < argc; a++) wanted |= strcmp(argv[a], tests[i].name) == 0;
        if (!wanted) continue;
        int before = harness_failures;
        tests[i].fn();
        ran++;
        printf("%-40s %s\n", tests[i].name, harness_failures == before ? "ok" : "FAILED");
    }
    printf("%d tests, %d checks, %d failures\n", ran, harness_checks, harness_failures);
    return harness_failures == 0 && ran > 0 ? 0 : 1;
}
