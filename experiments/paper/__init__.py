"""The paper's replication: LeNet/MNIST (compare, ablation, warm start) and the convex experiments."""
