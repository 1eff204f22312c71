"""The DLRM training loop, its checkpoints, metrics and run reports."""
