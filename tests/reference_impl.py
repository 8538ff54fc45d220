"""Slow, obvious float64 reference implementations (numpy), written independently of the package."""
from __future__ import annotations

import numpy as np


def iga_reference(A, B, gA, gB, scaling, tau, rank, normalize, binary=False, mask_off=False, chain=False):
    """Returns (g~, the rank-r truncation of the masked matrix, masked matrix, mask, V); with
    ``chain`` the chain-rule factor gradients of the masked matrix instead of g~."""
    A, B, gA, gB = (np.asarray(t, dtype=np.float64) for t in (A, B, gA, gB))
    N = gA.shape[0]
    G = np.stack([scaling * (gB[n] @ A + B @ gA[n]) for n in range(N)])
    mean = G.mean(axis=0)
    var = np.zeros_like(mean)
    for n in range(N):
        var += (G[n] - mean) ** 2
    var /= N
    if normalize == "none":
        vn = var
    elif normalize == "mean":
        vn = var / var.mean() if var.mean() > 0 else np.zeros_like(var)
    elif normalize == "snr":
        sq = mean**2
        vn = var / (sq + 1e-6 * sq.mean() + np.finfo(np.float64).tiny)
    mask = np.exp(-tau * vn)
    if binary:
        mask = (mask >= 0.5).astype(np.float64)
    if mask_off:
        mask = np.ones_like(mask)
    g = mean * mask
    if chain:
        return (scaling * g @ A.T, scaling * B.T @ g), g, mask, var
    U, S, Vt = np.linalg.svd(g, full_matrices=False)
    k = rank
    return (U[:, :k] * S[:k]) @ Vt[:k], g, mask, var


def and_mask_reference(grads, threshold, with_mask=False):
    grads = np.asarray(grads, dtype=np.float64)
    N = grads.shape[0]
    flat = grads.reshape(N, -1)
    out = np.zeros(flat.shape[1])
    mask = np.zeros(flat.shape[1])
    for e in range(flat.shape[1]):
        signs = [np.sign(flat[n, e]) for n in range(N)]
        if abs(sum(signs) / N) >= threshold:
            out[e] = flat[:, e].mean()
            mask[e] = 1.0
    out = (out / (mask.sum() / flat.shape[1] + 1e-10)).reshape(grads.shape[1:])
    return (out, mask) if with_mask else out


def sand_mask_reference(grads, tau, k, gamma, with_mask=False):
    grads = np.asarray(grads, dtype=np.float64)
    N = grads.shape[0]
    flat = grads.reshape(N, -1)
    mask = np.zeros(flat.shape[1])
    for e in range(flat.shape[1]):
        col = flat[:, e]
        agree = abs(np.sign(col).mean())
        var = max(col.var(ddof=1), 1e-17)
        mask[e] = max(0.0, np.tanh(k * (agree - tau) / (gamma * var)))
    out = (mask * flat.mean(axis=0) / (mask.sum() / mask.size + 1e-10)).reshape(grads.shape[1:])
    return (out, mask) if with_mask else out


def pcgrad_reference(vectors, orders):
    """vectors: N x P; orders[i]: the order in which domain i is projected off the others."""
    g = np.asarray(vectors, dtype=np.float64)
    N = g.shape[0]
    projected = []
    for i in range(N):
        gi = g[i].copy()
        for j in orders[i]:
            dot = gi @ g[j]
            if dot < 0:
                gi = gi - dot / (g[j] @ g[j]) * g[j]
        projected.append(gi)
    return np.mean(projected, axis=0)


def chain_rule_reference(g_tilde, A, B, scaling):
    """Factor gradients of a W-space direction through dW = s B A: (dA, dB)."""
    g_tilde, A, B = (np.asarray(t, dtype=np.float64) for t in (g_tilde, A, B))
    return scaling * B.T @ g_tilde, scaling * g_tilde @ A.T
