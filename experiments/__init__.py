"""The paper's experiments and the benchmarks, in five subpackages: ``run`` (one training run from a config),
``optim`` (every optimizer and its recipe), ``head_to_head`` (the harness and its reports), ``paper`` (the paper's
replication) and ``studies`` (one-off studies); each entry point is ``python -m experiments.<subpackage>.<name>``."""

import os

# jaxlib's CPU LAPACK (eigh, qr, svd, cholesky: the conditioners' refreshes, Shampoo's and K-FAC's inverse
# roots) is scipy's OpenBLAS, whose worker threads busy-wait for about 0.1 s after each call and take the
# cores from XLA's own thread pool: on 2 cores the steps after a refresh ran up to 2x slower, the refresh
# step itself 1.8x. Set before numpy or scipy load OpenBLAS (this package is imported first);
# a value the user exported wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
