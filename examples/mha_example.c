/* mha_example.c — torch.nn.MultiheadAttention's forward from C: a batch of
 * sequences (batch_first), a key-padding mask, and head-averaged weights. */
#include <stdio.h>
#include <stdlib.h>

#include "attn.h"

int main(void) {
    enum { N = 2, L = 5, E = 16, HEADS = 4 };
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, E, HEADS); /* PyTorch's defaults */
    cfg.batch_first = 1;
    cfg.init_seed = 7;
    attn_mha *mha = NULL;
    if (attn_mha_create(&cfg, &mha) != ATTN_OK) {
        fprintf(stderr, "create: %s\n", attn_last_error());
        return 1;
    }
    static float x[N][L][E], y[N][L][E], w[N][L][L];
    static unsigned char pad[N][L]; /* true = ignore this key */
    for (int n = 0; n < N; n++)
        for (int t = 0; t < L; t++)
            for (int e = 0; e < E; e++) x[n][t][e] = (float)((n + 1) * (t - e)) / 16.0f;
    pad[1][3] = pad[1][4] = 1; /* the second sequence is 3 tokens long */

    int64_t xs[3] = {N, L, E}, ws[3] = {N, L, L}, ps[2] = {N, L};
    attn_tensor tx, ty, tw, tp;
    attn_tensor_init(&tx, x, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&ty, y, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&tw, w, ATTN_DTYPE_F32, 3, ws);
    attn_tensor_init(&tp, pad, ATTN_DTYPE_BOOL, 2, ps);
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    fp.key_padding_mask = &tp;
    attn_status st = attn_mha_forward(mha, &tx, &tx, &tx, &fp, &ty, &tw);
    attn_mha_destroy(mha);
    if (st != ATTN_OK) {
        fprintf(stderr, "forward: %s\n", attn_last_error());
        return 1;
    }
    printf("y[1][0][0..3] = %.4f %.4f %.4f %.4f\n", y[1][0][0], y[1][0][1], y[1][0][2], y[1][0][3]);
    printf("weights of sequence 1, query 0 (keys 3, 4 padded): %.3f %.3f %.3f %.3f %.3f\n",
           w[1][0][0], w[1][0][1], w[1][0][2], w[1][0][3], w[1][0][4]);
    return w[1][0][3] == 0 && w[1][0][4] == 0 ? 0 : 1;
}
