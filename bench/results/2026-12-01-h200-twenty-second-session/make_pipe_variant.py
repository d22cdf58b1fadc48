"""The software-pipelined variant of ops/quant_decode.cu at b0d16df (line numbers of that file): the value products of
group i and the key products of group i + 1 in one basic block. Usage: python3 make_pipe_variant.py OUT.cu (from the repo
root at b0d16df); then PYTHONPATH=src python3 bench/probes/qd_ab.py OUT.json base pipe=OUT.cu"""
import sys

with open("ops/quant_decode.cu") as f:
    src = f.read().split("\n")
L = lambda a, b: src[a - 1:b]          # 1-based inclusive
hdr = L(222, 223)                       # st, tg
key = L(224, 260)                       # scores products -> acc, bias
tos = L(261, 278)                       # x, mask
smx = L(279, 321)                       # softmax (without the final syncwarp)
val = L(324, 389)                       # value products
rng = L(390, 409)                       # ring
# key products: acc/bias declared outside
key_body = [l for l in key if "float acc[NN][4][4], bias[NN][4];" not in l]
tos_body = [l for l in tos if "float x[NN][8];" not in l]
out = src[:220]
out += ["    auto key_products = [&](int i, float (&acc)[NN][4][4], float (&bias)[NN][4]) {"] + hdr + key_body + ["    };"]
out += ["    auto to_scores = [&](int i, float (&acc)[NN][4][4], float (&bias)[NN][4], float (&x)[NN][8]) {"] + hdr + tos_body + ["    };"]
out += ["    auto softmax = [&](float (&x)[NN][8]) {"] + smx + ["    };"]
out += ["    auto value_products = [&](int i) {"] + hdr + val + ["    };"]
out += ["    auto ring_values = [&](int i) {"] + hdr + rng + ["    };"]
out += """    {   // software-pipelined: values of group i and the key products of group i + 1 in one block
        #pragma unroll
        for (int j = 0; j < STAGES - 1; ++j) { if (j < ngrp) issue(j); cp_async_commit(); }
        cp_async_wait<STAGES - 2>();
        __syncwarp();
        float acc[NN][4][4], bias[NN][4], x[NN][8];
        if (ngrp > 0) { key_products(0, acc, bias); to_scores(0, acc, bias, x); softmax(x); }
        __syncwarp();
        for (int i = 0; i < ngrp; ++i) {
            if (i + STAGES - 1 < ngrp) issue(i + STAGES - 1);
            cp_async_commit();
            cp_async_wait<STAGES - 2>();
            __syncwarp();
            if (i + 1 < ngrp) {
                value_products(i);
                key_products(i + 1, acc, bias);
                ring_values(i);
                __syncwarp();
                to_scores(i + 1, acc, bias, x);
                softmax(x);
            } else {
                value_products(i);
                ring_values(i);
            }
            __syncwarp();
        }
    }""".split("\n")
out += src[411:]
with open(sys.argv[1], "w") as f:
    f.write("\n".join(out))
