/* exp2.c — the out-of-line scalar exp2 (see exp2.h): one definition, built
 * without ISA flags, that the driver and the vector kernels call. */
#include "exp2.h"

float attn__exp2f(float x) { return attn__exp2f_inline(x); }

double attn__exp2d(double x) { return attn__exp2d_inline(x); }
