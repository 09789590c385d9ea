"""Training: the RL loop (rl.py) and its stages (rows, critic, update, validation), SFT, checkpoints."""
