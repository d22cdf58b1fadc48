import ops.sparse_select as ss
import engine.policies.sparse as sp
_orig = (sp.channel_scores, sp.approx_scores)

def chan_sumabs(q_hat, kmax):
    return ss._grouped(q_hat, kmax.shape[1]).abs().sum(2) * kmax.float()

def _per_head(q, kt_rows, channels):
    qg = ss._grouped(q, kt_rows.shape[1])
    idx = channels[:, :, None, :].expand(-1, -1, qg.shape[2], -1)
    return (qg.gather(3, idx) @ kt_rows.float()) * (q.shape[-1] ** -0.5)   # [B,Hkv,G,N]

def approx_max(q, kt_rows, channels):
    return _per_head(q, kt_rows, channels).log_softmax(-1).amax(2)

def approx_psum(q, kt_rows, channels):
    return _per_head(q, kt_rows, channels).softmax(-1).sum(2)

def apply_variant(variant):
    kw = {}
    if "chsum" in variant: sp.channel_scores = chan_sumabs
    if "max" in variant: sp.approx_scores = approx_max
    if "psum" in variant: sp.approx_scores = approx_psum
    for tokn in variant.split("+"):
        if tokn.startswith("r") and tokn[1:].isdigit(): kw["channels"] = int(tokn[1:])
        if tokn.startswith("sink"): kw["sink"] = int(tokn[4:])
        if tokn.startswith("rec"): kw["recent"] = int(tokn[3:])
    return kw

def restore():
    sp.channel_scores, sp.approx_scores = _orig
