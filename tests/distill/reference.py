"""Straightforward (loop-based, fp64, dense) references of the distillation losses."""

from __future__ import annotations

import torch


def chunk_rows(chunk_id_row, c):
    return [i for i, x in enumerate(chunk_id_row.tolist()) if x == c]


def reference_projection_kl(
    s_logits,
    t_logits,
    s_cid,
    t_cid,
    pair_valid,
    pair_correct,
    m_dense,
    *,
    k,
    tau,
    reverse,
    exact_only,
    sample_mask,
):
    """Returns (loss, number of valid chunks); differentiable in ``s_logits`` (fp64)."""
    v_t = min(m_dense.size(1), t_logits.size(-1))
    s_lp = torch.log_softmax(s_logits.double() / tau, -1)[:, :-1]
    proj = s_lp.exp() @ m_dense.double()[:, :v_t]
    teacher = t_logits.double()[:, :-1, :v_t]
    s_c, t_c = s_cid[:, 1:], t_cid[:, 1:]
    rows = [teacher[b, t] for b in range(teacher.size(0)) for t in range(teacher.size(1)) if t_c[b, t] >= 0]
    importance = torch.stack(rows).max(0).values
    top = torch.topk(importance, min(k, v_t)).indices.sort().values
    total, n = 0.0, 0
    for b in range(s_logits.size(0)):
        for c in range(pair_valid.size(1)):
            srows, trows = chunk_rows(s_c[b], c), chunk_rows(t_c[b], c)
            ok = pair_valid[b, c] and srows and trows and sample_mask[b]
            if exact_only:
                ok = ok and pair_correct[b, c]
            if not ok:
                continue
            q = proj[b, srows][:, top].mean(0)
            log_q = torch.log(q / (q.sum() + 1e-10) + 1e-10)
            log_p = torch.log_softmax(teacher[b, trows][:, top] / tau, -1).mean(0)
            if reverse:
                kl = (log_q.exp() * (log_q - log_p)).sum()
            else:
                kl = (log_p.exp() * (log_p - log_q)).sum()
            total = total + kl
            n += 1
    return total / max(n, 1) * tau * tau, n


def reference_gold(
    s_logits, t_logits, s_cid, t_cid, pair_valid, emap, *, v_t, tau, reverse, topk, sample_mask
):
    s_lp = torch.log_softmax(s_logits.double() / tau, -1)[:, :-1]
    t_lp = torch.log_softmax(t_logits.double()[..., :v_t] / tau, -1)[:, :-1]
    s_c, t_c = s_cid[:, 1:], t_cid[:, 1:]
    cs, ct, us, ut = (
        emap[x] for x in ("common_student", "common_teacher", "uncommon_student", "uncommon_teacher")
    )
    kl_total, l1_total, n = 0.0, 0.0, 0
    for b in range(s_logits.size(0)):
        for c in range(pair_valid.size(1)):
            srows, trows = chunk_rows(s_c[b], c), chunk_rows(t_c[b], c)
            if not (pair_valid[b, c] and srows and trows and sample_mask[b]):
                continue
            s_mean, t_mean = s_lp[b, srows].mean(0), t_lp[b, trows].mean(0)
            sc, tc = s_mean[cs], t_mean[ct]
            if reverse:
                kl_total = kl_total + (sc.exp() * (sc - tc)).sum()
            else:
                kl_total = kl_total + (tc.exp() * (tc - sc)).sum()
            m = min(len(us), len(ut), topk)
            if m:
                s_sorted = s_mean[us].exp().sort(descending=True).values[:m]
                t_sorted = t_mean[ut].exp().sort(descending=True).values[:m]
                l1_total = l1_total + (s_sorted - t_sorted).abs().sum()
            n += 1
    d = max(n, 1)
    return (kl_total / d + l1_total / d) * tau * tau, kl_total / d, l1_total / d, n
