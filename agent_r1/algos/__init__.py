"""RL math on plain tensors: step-level advantage estimators (`advantages`) and token-level policy,
value and KL losses (`losses`). No model, no trainer state: every function is pure and tested against
hand-computed golden values in tests/algos."""
