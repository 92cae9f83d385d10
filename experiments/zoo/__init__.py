"""The workload zoo: standard architectures as their authors write them, on offline data, each trained by every
row of the zoo's table with the same batches (``python -m experiments.zoo.run``)."""
