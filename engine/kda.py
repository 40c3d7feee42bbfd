"""Kimi Delta Attention's recurrence (the gated delta rule of Ling-3.0's linear-attention layers):
one token at a time for decode steps, chunk by chunk for prefill, and how a batch's rows map onto
runs of adjacent state slots."""

from __future__ import annotations

import torch

KDA_CHUNK = 16  # tokens per chunk of the prefill recurrence
# A chunk whose log-decays sum to more than -FACTORED_SPAN (per channel) forms its pairwise decays as
# e^{G_t} * e^{-G_s}: e^80 ~ 5.5e34, so those factors, and sums of a head's worth of their products,
# stay finite in float32 (max ~3.4e38). Ling's bounded gate (>= -5 per token) always allows it over
# 16 tokens; an unbounded gate falls back, per chunk, to forming e^{G_t - G_s} pair by pair.
FACTORED_SPAN = 80.0


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (eps inside the root, as Ling's kernels do)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(q, k, v, log_decay, beta, state):
    """One token of the gated delta rule for a batch. q, k, log_decay: [B, h, dk]; v: [B, h, dv];
    beta: [B, h]; state: [B, h, dk, dv] (updated in place). Returns the output [B, h, dv].

    The state is read once for both k^T S and q^T S (after the decay), and the output of the
    updated state is q^T S + (q . k) u: the state is streamed twice a token (decay, rank-1 update)
    plus one read, instead of once more for the output."""
    B, h, dk, dv = state.shape
    state.mul_(log_decay.exp().unsqueeze(-1))
    reads = torch.matmul(torch.stack([k, q], dim=2), state)  # [B, h, 2, dv]: k^T S, q^T S
    update = (v - reads[:, :, 0]) * beta.unsqueeze(-1)
    state.view(B * h, dk, dv).baddbmm_(k.reshape(B * h, dk, 1), update.reshape(B * h, 1, dv))
    return reads[:, :, 1] + (q * k).sum(-1, keepdim=True) * update


def slot_runs(slots: list[int]) -> list[tuple[list[int], int]]:
    """The batch's rows grouped into runs of consecutive state slots: [(rows, first slot), ...].
    A run's states are one view of the pool, updated in place (no gather and scatter)."""
    runs: list[tuple[list[int], int]] = []
    for row in sorted(range(len(slots)), key=slots.__getitem__):
        if runs and slots[row] == runs[-1][1] + len(runs[-1][0]):
            runs[-1][0].append(row)
        else:
            runs.append(([row], slots[row]))
    return runs


def delta_rule_chunked(q, k, v, log_decay, beta, state, chunk: int = KDA_CHUNK):
    """The gated delta rule over a sequence, `chunk` tokens at a time. q, k, log_decay: [T, h, dk];
    v: [T, h, dv]; beta: [T, h]; state: [h, dk, dv]. Returns (output [T, h, dv], final state).

    Within a chunk with starting state S0 and per-channel cumulative log-decay G_t (sum of the
    chunk's log-decays up to t), unrolling S_t = diag(e^{g_t}) S_{t-1} + k_t u_t^T gives
      S_t = diag(e^{G_t}) S0 + sum_{s<=t} diag(e^{G_t - G_s}) k_s u_s^T,
    where u_t = beta_t (v_t - k_t^T diag(e^{g_t}) S_{t-1}), i.e.
      u_t + beta_t sum_{s<t} A_ts u_s = beta_t (v_t - (k_t * e^{G_t})^T S0),
      A_ts = sum_c k_t[c] k_s[c] e^{G_t[c] - G_s[c]},
    a unit lower-triangular system solved for all u at once. Outputs are
      o_t = (q_t * e^{G_t})^T S0 + sum_{s<=t} (sum_c q_t[c] k_s[c] e^{G_t[c] - G_s[c]}) u_s.
    The pairwise decays e^{G_t - G_s} are products e^{G_t} e^{-G_s} (two matmuls) where the chunk's
    decay is bounded (see FACTORED_SPAN), else formed pair by pair ([h, c, c, dk], slower)."""
    T = q.shape[0]
    outputs = []
    q, k, v, log_decay = (x.transpose(0, 1) for x in (q, k, v, log_decay))  # [h, T, d]
    beta = beta.transpose(0, 1)  # [h, T]
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        c = end - start
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        G = log_decay[:, start:end].cumsum(1)  # [h, c, dk], decreasing along c
        decay_in = G.exp()
        if float(G[:, -1].min()) > -FACTORED_SPAN:
            k_out = kc * (-G).exp()
            k_pair = (kc * decay_in) @ k_out.transpose(1, 2)  # [h, t, s]; only s < t is used
            q_pair = ((qc * decay_in) @ k_out.transpose(1, 2)).tril()
        else:
            causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
            pair = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~causal[:, :, None], float("-inf")).exp()
            k_pair = torch.einsum("htc,htsc,hsc->hts", kc, pair, kc)
            q_pair = torch.einsum("htc,htsc,hsc->hts", qc, pair, kc)
        rhs = bc.unsqueeze(-1) * (vc - (kc * decay_in) @ state)
        system = torch.eye(c, dtype=q.dtype, device=q.device) + bc.unsqueeze(-1) * k_pair.tril(-1)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outputs.append((qc * decay_in) @ state + q_pair @ u)
        decay_out = (G[:, -1:] - G).exp()  # [h, c, dk]: from each token to the chunk's end
        state = G[:, -1].exp().unsqueeze(-1) * state + (kc * decay_out).transpose(1, 2) @ u
    return torch.cat(outputs, dim=1).transpose(0, 1), state
