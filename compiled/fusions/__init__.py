"""Custom ops built from the ops of several op folders: the MoE experts with the next layer's
residual add + RMSNorm and linear."""
