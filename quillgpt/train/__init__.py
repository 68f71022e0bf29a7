"""Training: the loop (loop), the run directory and resume policy (run_dir), the lr schedule and
time budget (schedule), optimizers (optim), DDP/FSDP (distributed, fsdp_checkpoint), the log
(metrics) and its curves (curves), the fit estimate (memory), prefix-LM batches (prefix_batches)."""
