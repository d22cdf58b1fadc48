"""Variant of ops/quant_decode.cu (at 79a0a26): a group's keys staged half a step earlier. The key region of stage
i % STAGES is free once group i's scores are done, so group i + STAGES's keys are issued there right after the
softmax of group i (its values at the start of body i + 1, as before); two cp.async commit groups per group (keys,
values). Usage (repo root): python3 make_early_keys_variant.py OUT.cu"""
import sys

with open("ops/quant_decode.cu") as f:
    s = f.read()

old_issue = s[s.index("    auto issue = [&](int i) {"):s.index("    auto body = [&](int i) {")]
new_issue = old_issue.replace("    auto issue = [&](int i) {", "    auto issue_keys = [&](int i) {", 1)
k_end = new_issue.index("        if (vq - tg >= 64) {")
keys_part = new_issue[:k_end] + "    };\n"
vals_part = ("    auto issue_values = [&](int i) {\n"
             "        unsigned* st = wst + (i % STAGES) * STAGE_WORDS;\n"
             "        const long long tg = w0 + 64LL * i;\n" + new_issue[k_end:])
s = s.replace(old_issue, keys_part + vals_part, 1)

sync = "        __syncwarp();\n\n        // ---- 3. values ----"
assert sync in s
s = s.replace(sync, "        __syncwarp();\n        if (i + STAGES < ngrp) issue_keys(i + STAGES);   // stage i's key region is free\n"
                    "        cp_async_commit();\n\n        // ---- 3. values ----", 1)

old_pipe = "    warp_pipeline<STAGES>(ngrp, issue, body);"
assert old_pipe in s
s = s.replace(old_pipe, r'''    // commit order: K0 V0 K1 V1 .. K(S-1), then per body i: V(i+S-1) at its start, K(i+S) after its softmax; before
    // body i the groups after V(i) are K(i+1) V(i+1) .. K(i+S-1) V(i+S-1): 2 (STAGES - 1) may be pending
    #pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) {
        if (j < ngrp) issue_keys(j);
        cp_async_commit();
        if (j < ngrp) issue_values(j);
        cp_async_commit();
    }
    if (STAGES - 1 < ngrp) issue_keys(STAGES - 1);
    cp_async_commit();
    for (int i = 0; i < ngrp; ++i) {
        if (i + STAGES - 1 < ngrp) issue_values(i + STAGES - 1);
        cp_async_commit();
        cp_async_wait<2 * (STAGES - 1)>();
        __syncwarp();
        body(i);
        __syncwarp();
    }''', 1)
with open(sys.argv[1], "w") as f:
    f.write(s)
