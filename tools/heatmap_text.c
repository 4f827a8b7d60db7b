/*
 * heatmap_text.c — token files for `attn heatmap`: one token per line.
 *
 * Lines end in "\n" or "\r\n"; a last line without one counts, an empty
 * line is an empty token. Cairo draws UTF-8 only (an invalid string stops
 * all later drawing), so bytes that are not UTF-8 and control characters
 * become U+FFFD. A token longer than HM_TOKEN_BYTES is cut at a character
 * boundary and ends in "…" (the drawing shortens it further to its width).
 * Files above 64 MiB are refused, so /dev/zero or a wrong file ends quickly.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "heatmap.h"

enum { MAX_FILE = 64 << 20 };

static const char replacement[] = "\xef\xbf\xbd"; /* U+FFFD */
static const char ellipsis[] = "\xe2\x80\xa6";    /* U+2026 */

/* Length of the valid UTF-8 character at s (n bytes left), or 0: no
 * overlong forms, surrogates or code points above U+10FFFF. */
static size_t utf8_char(const unsigned char *s, size_t n) {
    if (s[0] < 0x80) return 1;
    size_t len = s[0] >= 0xc2 && s[0] <= 0xdf   ? 2
                 : s[0] >= 0xe0 && s[0] <= 0xef ? 3
                 : s[0] >= 0xf0 && s[0] <= 0xf4 ? 4
                                                : 0;
    if (len == 0 || len > n) return 0;
    for (size_t i = 1; i < len; i++)
        if ((s[i] & 0xc0) != 0x80) return 0;
    if (s[0] == 0xe0 && s[1] < 0xa0) return 0; /* overlong */
    if (s[0] == 0xed && s[1] > 0x9f) return 0; /* surrogate */
    if (s[0] == 0xf0 && s[1] < 0x90) return 0; /* overlong */
    if (s[0] == 0xf4 && s[1] > 0x8f) return 0; /* above U+10FFFF */
    return len;
}

/* Copies one line (len bytes) cleaned into out, which has room for
 * HM_TOKEN_BYTES + 4 bytes; returns the bytes written, NUL not counted. */
static size_t clean_line(const unsigned char *line, size_t len, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        size_t k = utf8_char(line + i, len - i);
        const char *piece = (const char *)line + i;
        size_t plen = k;
        if (k == 0 || (k == 1 && (line[i] < 0x20 || line[i] == 0x7f))) {
            piece = replacement;
            plen = 3;
            k = k == 0 ? 1 : k;
        }
        if (o + plen > HM_TOKEN_BYTES) {
            memcpy(out + o, ellipsis, 3);
            o += 3;
            break;
        }
        memcpy(out + o, piece, plen);
        o += plen;
        i += k;
    }
    out[o] = '\0';
    return o;
}

/* The whole file, NUL-terminated; NULL with a message printed. */
static unsigned char *read_all(const char *option, const char *path, size_t *size) {
    FILE *f = cli_open_input(path);
    if (f == NULL) {
        fprintf(stderr, "attn heatmap: reading %s '%s': %s\n", option, path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, n = 0;
    unsigned char *buf = malloc(cap + 1);
    const char *failed = buf == NULL ? strerror(ENOMEM) : NULL;
    while (failed == NULL) {
        if (n == cap) {
            unsigned char *bigger = cap >= MAX_FILE ? NULL : realloc(buf, 2 * cap + 1);
            if (bigger == NULL) {
                failed = cap >= MAX_FILE ? "larger than 64 MiB: not a token file"
                                         : strerror(ENOMEM);
                break;
            }
            buf = bigger;
            cap *= 2;
        }
        errno = 0;
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) {
            if (ferror(f)) failed = errno != 0 ? strerror(errno) : "read error";
            break;
        }
    }
    fclose(f);
    if (failed != NULL) {
        fprintf(stderr, "attn heatmap: reading %s '%s': %s\n", option, path, failed);
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    *size = n;
    return buf;
}

int hm_tokens_read(const char *option, const char *path, int64_t want, const char *what,
                   hm_tokens *t) {
    memset(t, 0, sizeof *t);
    size_t size;
    unsigned char *text = read_all(option, path, &size);
    if (text == NULL) return CLI_RUNTIME;
    int64_t lines = 0;
    for (size_t i = 0; i < size; i++) lines += text[i] == '\n';
    if (size > 0 && text[size - 1] != '\n') lines++;
    if (lines != want) {
        fprintf(stderr,
                "attn heatmap: %s '%s' has %lld token%s (one per line) but the weights have "
                "%lld %s\n",
                option, path, (long long)lines, lines == 1 ? "" : "s", (long long)want, what);
        free(text);
        return CLI_RUNTIME;
    }
    /* Each cleaned token takes at most HM_TOKEN_BYTES + 4 bytes; want is
     * small (a side of the image, checked before). */
    size_t room = (size_t)lines * (HM_TOKEN_BYTES + 4);
    t->buf = malloc(room > 0 ? room : 1);
    t->tok = malloc((size_t)(lines > 0 ? lines : 1) * sizeof *t->tok);
    if (t->buf == NULL || t->tok == NULL) {
        fprintf(stderr, "attn heatmap: reading %s '%s': %s\n", option, path, strerror(ENOMEM));
        free(text);
        hm_tokens_free(t);
        return CLI_RUNTIME;
    }
    size_t at = 0, start = 0;
    for (int64_t k = 0; k < lines; k++) {
        size_t end = start;
        while (end < size && text[end] != '\n') end++;
        size_t len = end - start;
        if (len > 0 && text[start + len - 1] == '\r') len--;
        t->tok[k] = t->buf + at;
        at += clean_line(text + start, len, t->buf + at) + 1;
        start = end + 1;
    }
    t->n = lines;
    free(text);
    return CLI_OK;
}

void hm_tokens_free(hm_tokens *t) {
    free(t->tok);
    free(t->buf);
    memset(t, 0, sizeof *t);
}
