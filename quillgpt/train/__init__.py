"""Training: the loop (loop) over the trainer's state (state), the run directory and resume policy
(run_dir), the lr schedule and time budget (schedule), optimizers (optim), DDP/FSDP (distributed,
fsdp_checkpoint), the log (metrics), the fit estimate (memory), threads that give way (cpu_share)."""
