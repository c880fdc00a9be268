"""pass@k: the chance that at least one of k attempts at a problem passes.

Sampling exactly k attempts and checking whether one passes is a high-variance
estimate. Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", arXiv:2107.03374, eq. 1) draw n >= k samples, count the c that pass,
and take the unbiased estimate

    pass@k = 1 - C(n - c, k) / C(n, k)

the probability that k samples drawn without replacement from the n include
a passing one. pass@1 is c / n. The benchmark's pass@k is the mean over its
problems.
"""

from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from `n` samples of which `c` passed."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)  # comb(n - c, k) is 0 when n - c < k: some draw passes
