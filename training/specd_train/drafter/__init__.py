"""`specd train-drafter`: distil a small draft model for a target from the target's own logits."""
