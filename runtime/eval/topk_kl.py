"""KL divergence from a saved reference that kept only part of each token's distribution
(runtime/eval/reference.py), and llama-perplexity's other statistics (Δp, KL percentiles).

For one token, with the reference P (its top-k set S; the tail T = the rest, of mass P_T) and the
candidate Q (all of it, computed now):

    KL(P||Q) = sum_S p log(p/q)  +  sum_T p log(p/q)  =  exact  +  P_T * E_{i ~ P|T}[log p_i - log q_i]

The first sum is exact. The tail's expectation is estimated from m tokens the reference drew from its own
tail (P restricted to T; their ids and log p are saved): an unbiased estimate, whose standard error is
known from the draws' spread. The candidate's tail mass Q_T is known exactly, which makes a control variate:
with x = (q_i / p_i) / (Q_T / P_T), whose mean over P|T is exactly 1,

    sum_T p log(p/q)  =  P_T log(P_T / Q_T)  +  P_T * E[x - 1 - log x]

The first term is the log-sum inequality's floor; the second averages a quantity that is >= 0 and flat at
x = 1 (second order in log x where log(p/q) is first order), so the same draws give a narrower interval:
on the held-out check's Q4_0 (10 windows of 512) the plain mean of log(p/q) had missed the full-logit KL
by 8.0e-4 against its own ±7.8e-4. The tail matters: at k = 64 the default model leaves 12% of its mass
outside the top k, and the top k alone miss 20% of int8's KL (0.00203 of 0.00254) and 16% of
int4-g128's; no bound from the tail's mass alone is tight (the log-sum inequality gives the lower bound
P_T log(P_T / Q_T), kept as `kl_lower`; the worst case above it puts the mass on the candidate's least
likely tokens: 2.9 nats). With 128 draws, 2 windows, the plain mean of log(p/q) over the draws gave int8
0.002588 against the full 0.002543 (standard error 8.7e-5), int4-g128 0.4565 against 0.4550 (1.0e-3), k8v4
0.003486 against 0.003381 (1.0e-4); the control variate below narrows such intervals 1.5-19x.
The figure is printed with ±2.58 standard errors of the mean (99%), which tests/test_eval_reference.py
holds against the full-logit KL.
"""

from __future__ import annotations

import torch

from lowbit.runtime.eval.evaluate import perplexity

KL_QUANTILES = {"kl_median": 0.5, "kl_p90": 0.9, "kl_p99": 0.99, "kl_p999": 0.999}
DP_QUANTILES = {"dp_p01": 0.01, "dp_p99": 0.99}
Z99 = 2.576  # the printed interval: this many standard errors of the mean KL's tail estimate


def token_kl(ref: dict, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ref: the saved rows of n tokens (top_ids/top_lp [n, k], log_tail [n], tail_ids/tail_lp [n, m]); got: the
    candidate's log-probs [n, V]. → (the KL estimate [n], its sampling variance [n], the lower bound [n]),
    float64."""
    # the candidate's tail mass, as the reference computed its own (runtime/eval/reference.py: fp32 logsumexp over
    # the same ids), so that a candidate equal to the reference scores exactly 0
    log_qt = got.float().scatter(1, ref["top_ids"].long(), float("-inf")).logsumexp(-1).double()
    got = got.double()
    top_lp = ref["top_lp"].double()
    kl_top = (top_lp.exp() * (top_lp - got.gather(1, ref["top_ids"].long()))).sum(-1)  # [n]
    log_pt = ref["log_tail"].double()
    pt = log_pt.exp()
    gap = torch.where(pt > 0, log_pt - log_qt, torch.zeros_like(pt))  # log(P_T / Q_T)
    lower = kl_top + pt * gap
    # at the draws, log x = log(q/p) - log(Q_T/P_T), whose x has mean 1 over P|T exactly; the tail's share is
    # P_T * (gap + E[x - 1 - log x]), and x - 1 - log x (>= 0, 0 at x = 1) varies far less than log(p/q)
    log_x = got.gather(1, ref["tail_ids"].long()) - ref["tail_lp"].double() + gap[:, None]  # [n, m]
    g = torch.expm1(log_x) - log_x
    m = g.shape[1]
    estimate = lower + pt * g.mean(-1)
    variance = (pt * g.std(-1)) ** 2 / m if m > 1 else torch.zeros_like(pt)
    return estimate, variance, lower


class TopkScores:
    """Running per-token statistics of one candidate against a saved reference."""

    def __init__(self):
        self.nll: list[torch.Tensor] = []
        self.kl: list[torch.Tensor] = []
        self.var: list[torch.Tensor] = []
        self.lower: list[torch.Tensor] = []
        self.dp: list[torch.Tensor] = []
        self.same_top1 = 0

    def add(self, ref: dict, got: torch.Tensor, targets: torch.Tensor) -> None:
        """got: the candidate's log-probs [n, V] predicting targets [n]; ref: the reference's rows."""
        estimate, variance, lower = token_kl(ref, got)
        self.kl.append(estimate)  # not clamped: a token's estimate below 0 is the draws' noise, which the mean cancels
        self.var.append(variance)
        self.lower.append(lower.clamp_min(0))
        tgt = got.gather(1, targets[:, None])[:, 0].double()
        self.nll.append(-tgt)
        self.dp.append(tgt.exp() - ref["target_lp"].double().exp())  # llama-perplexity's Δp: p(next token) moved
        self.same_top1 += int((ref["top_ids"][:, 0].long() == got.argmax(-1)).sum())

    def summary(self) -> dict:
        nll, kl, var, lower, dp = (torch.cat(x) for x in (self.nll, self.kl, self.var, self.lower, self.dp))
        n = nll.numel()
        ppl, stderr = perplexity(nll)
        out = {"ppl": ppl, "ppl_stderr": stderr,
               "kl_mean": float(kl.mean()), "kl_tail_bound": Z99 * float(var.sum().sqrt()) / n,
               "kl_lower": float(lower.mean()), "kl_max": float(kl.max()),
               "top1_pct": 100.0 * self.same_top1 / n, "tokens": n,
               "dp_mean": float(dp.mean()), "dp_rms": float(dp.square().mean().sqrt())}
        kl = kl.clamp_min(0)  # a token's KL is >= 0: its percentiles read the clamped values
        out.update({k: float(kl.quantile(q)) for k, q in KL_QUANTILES.items()})
        out.update({k: float(dp.quantile(q)) for k, q in DP_QUANTILES.items()})
        return out
