"""The convex case: multiclass logistic regression with SGD and every conditioner of the paper.

  python -m experiments.paper.convex --config configs/paper/convex.py \
      --results_dir experiments/results/convex --data_dir ../shared/tfds

Runs the update of Equation (updateGeneric), ``W <- W - eta (A^{-1} x) delta^T`` (here in the
``(n, p)`` layout), with a constant step and the averaged iterate ``W_bar`` of Lemma 1, for
``A = I`` (SGD), ``A = C^{1/2}`` (Theorem 1), the exact rank-k conditioner (Section 2.2,
Theorem 2) and Algorithm 1's sketch from ``X`` (Theorem 3). ``C = X^T X / m`` is exact over the
training set, so every ``A`` is fixed and ``A^{-1} x`` is precomputed once per conditioner.

One job per module: ``problem`` (data, loss, optimum, conditioners, the SGD runs), ``theory``
(Lemmas 3-4 and the cost of Algorithm 1), ``experiment`` (runs them from a config), ``report``
(``results.json``, PNG plots, ``README.md``); ``__main__`` is the command line.
"""
